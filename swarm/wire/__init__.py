"""Transport: tensor codecs and wire encoding, the streamed request form, the gRPC client and its
pool, chunked blobs, message parsing, channel options and the generated protobuf code of
proto/swarm.proto."""
