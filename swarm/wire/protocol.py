"""The generated protobuf (`pb`) and gRPC (`rpc`) modules of proto/swarm.proto.

They are generated on first import when missing or stale (see swarm.wire.codegen), so that a fresh
editable checkout works without a separate build step.
"""

from swarm.wire.codegen import ensure_generated

ensure_generated()

from swarm.wire.generated import swarm_pb2 as pb  # noqa: E402
from swarm.wire.generated import swarm_pb2_grpc as rpc  # noqa: E402

__all__ = ["pb", "rpc"]
