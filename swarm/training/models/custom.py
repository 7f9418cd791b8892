"""Your own model: stages built by a factory in a module of yours, and what they take and return.

A model module (examples/tiny_mlp.py, examples/char_model.py) defines
    build_stages(num_stages, **kwargs) -> [stage modules]    stage k < S-1 maps its input to stage k+1's; the
                                                             last is called as stage(x, targets) and returns the
                                                             per-sample loss (or the mean loss)
    SWARM = {                                                what the swarm needs to know about it
        "input":   {"shape": [16], "dtype": "float32"},      stage 0's input, one sample (int dtypes: "range")
        "targets": {"shape": [], "dtype": "int64", "range": [0, 4]},   the last stage's targets, one sample
        "data":    {"factory": "make_dataset"}                a dataset factory of this module, or a built-in
                                                             dataset: {"kind": "stdlib", "seq_len": 64,
                                                             "vocab_size": 256} (byte tokens, like --model gpt)
    }
    make_dataset(seed: int, **data_kwargs) -> an object with num_train, num_val, train(indices) and val(indices)
                                                             returning (inputs, targets) batches

`custom_spec` reads SWARM on the command line that names the factory (`--custom-model`) and writes its facts
into the run config's model spec ("input_shape", "input_dtype", "targets_*", ...) and data config, so a peer
needs the module (on its PYTHONPATH, or --custom-model-path) but never reads SWARM itself. A run config written
by hand with these keys works as before.

Security (issue 14): a peer imports the factory that the run config names. Until the run config is signed and
checked, set SWARM_ALLOWED_FACTORIES (comma-separated module prefixes) on peers and trainers so that they import
nothing else: `check_factory_allowed` refuses other factories.
"""

from __future__ import annotations

import copy
import importlib
import os

import torch
from torch import nn

from swarm.core.errors import ConfigError

ALLOW_ENV = "SWARM_ALLOWED_FACTORIES"
DATA_KINDS = ("stdlib", "text", "tokens")


def check_factory_allowed(path: str) -> None:
    """The allow-list hook: with SWARM_ALLOWED_FACTORIES set, only factories of those module prefixes load."""
    allowed = [p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()]
    module = path.partition(":")[0]
    if allowed and not any(module == p or module.startswith(p + ".") for p in allowed):
        raise ConfigError(
            f"factory {path!r} is not allowed here ({ALLOW_ENV}={','.join(allowed)}): add its module to that list "
            "if you trust it"
        )


def load_factory(path: str):
    """The object named by 'package.module:attribute' (ValueError with the cause when it cannot be imported)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a factory is named 'package.module:function', got {path!r}")
    check_factory_allowed(path)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"cannot import model factory {path!r} ({e}): put its folder on PYTHONPATH or give --custom-model-path"
        ) from e


def _tensor_keys(prefix: str, decl: object) -> dict:
    if not isinstance(decl, dict) or not isinstance(decl.get("shape", []), list):
        raise ConfigError(f"SWARM[{prefix!r}] must be a dict like {{'shape': [16], 'dtype': 'float32'}}")
    out = {f"{prefix}_shape": list(decl.get("shape", [])), f"{prefix}_dtype": str(decl.get("dtype", "float32"))}
    if not isinstance(getattr(torch, out[f"{prefix}_dtype"], None), torch.dtype):
        raise ConfigError(f"SWARM[{prefix!r}] has dtype {out[f'{prefix}_dtype']!r}, not a torch dtype name")
    if "range" in decl:
        out[f"{prefix}_range"] = [int(v) for v in decl["range"]]
    return out


def custom_spec(factory: str) -> tuple[dict, dict]:
    """(model spec, data config fields) for `--custom-model factory`, from its module's SWARM declaration."""
    module_name = factory.partition(":")[0]
    load_factory(factory)  # a clear error now if it cannot be imported
    decl = getattr(importlib.import_module(module_name), "SWARM", None)
    spec: dict = {"kind": "custom", "factory": factory}
    if decl is None:
        return spec, {}  # the older form: input_shape etc. given in a --config file
    if not isinstance(decl, dict):
        raise ConfigError(f"{module_name}.SWARM must be a dict with 'input', 'targets' and 'data'")
    spec.update(_tensor_keys("input", decl.get("input", {})))
    spec.update(_tensor_keys("targets", decl.get("targets", {"dtype": "int64"})))
    data = decl.get("data")
    if isinstance(data, dict) and "factory" in data:
        name = str(data["factory"])
        return spec, {"kind": "custom", "factory": name if ":" in name else f"{module_name}:{name}"}
    if isinstance(data, dict) and data.get("kind") in DATA_KINDS:
        spec.update({k: int(data[k]) for k in ("seq_len", "vocab_size") if k in data})
        return spec, {"kind": data["kind"]}
    raise ConfigError(
        f"{module_name}.SWARM['data'] must be {{'factory': 'make_dataset'}} or a built-in dataset such as "
        "{'kind': 'stdlib', 'seq_len': 64, 'vocab_size': 256}"
    )


def trace_input(stages: list[nn.Module], spec: dict, stage: int) -> torch.Tensor:
    """A meta tensor shaped like stage `stage`'s input: stage 0's declared input traced through the earlier
    stages on the meta device (no memory, no compute)."""
    dtype = getattr(torch, spec.get("input_dtype", "float32"))
    x = torch.empty((2, *spec.get("input_shape", ())), dtype=dtype, device="meta")
    with torch.no_grad():
        for k in range(stage):
            x = copy.deepcopy(stages[k]).to("meta")(x)
    return x


def build_custom_stages(spec: dict, num_stages: int) -> list[nn.Module]:
    factory = load_factory(spec["factory"])
    torch.manual_seed(int(spec.get("seed", 0)))
    stages = factory(num_stages=num_stages, **dict(spec.get("kwargs", {})))
    if len(stages) != num_stages:
        raise ValueError(f"{spec['factory']} returned {len(stages)} stages, expected {num_stages}")
    return stages


def value_range(spec: dict, prefix: str) -> tuple[int, int] | None:
    bounds = spec.get(f"{prefix}_range")
    return (int(bounds[0]), int(bounds[1])) if bounds else None
