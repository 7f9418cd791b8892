"""Names that configs use for wire options, without importing the generated protobuf code (so that
reading a run config never runs code generation)."""

from __future__ import annotations

CODECS: tuple[str, ...] = ("none", "fp16", "bf16", "int8")
