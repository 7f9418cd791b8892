"""gRPC channel and server options shared by both ends."""

MiB = 1 << 20


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """HTTP/2 and message limits shared by servers and clients (large windows for big tensors)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.lookahead_bytes", 16 * MiB),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.http2.max_frame_size", 16 * MiB - 1),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # reconnecting after a network cut: gRPC's defaults (a 20 s minimum per connection attempt,
        # back-off growing to 120 s) are meant for services, and kept a peer whose link came back
        # unreachable for tens of seconds; a swarm's peers come and go
        ("grpc.initial_reconnect_backoff_ms", 1_000),
        ("grpc.min_reconnect_backoff_ms", 5_000),  # gRPC's MIN_CONNECT_TIMEOUT: one attempt's deadline
        ("grpc.max_reconnect_backoff_ms", 10_000),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The channel options plus what lets clients' keepalive pings through: a server keeps gRPC's
    default minimum ping interval (5 min) otherwise, and answers a client that pings every 10 s with
    GOAWAY too_many_pings (ENHANCE_YOUR_CALM): its calls fail and the channel reconnects (seen in
    chaos runs, where channels idle between a peer's rare calls)."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]
