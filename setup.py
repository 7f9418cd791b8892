"""Build hook: generate the gRPC/protobuf modules from proto/swarm.proto (never hand-edited)."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _generate() -> None:
    spec = importlib.util.spec_from_file_location("_swarm_codegen", ROOT / "swarm" / "wire" / "codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    codegen.generate(ROOT / "proto" / "swarm.proto", ROOT / "swarm" / "wire" / "generated")


class BuildPyWithProto(build_py):
    def run(self) -> None:
        _generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProto})
