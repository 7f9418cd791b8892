"""gRPC over TLS in a private swarm: a peer's server credentials (renewable: gRPC asks for the newest
certificate at each handshake) and the channel credentials that trust only the run's CA
(swarm.core.tls makes and checks the certificates)."""

from __future__ import annotations

import threading

import grpc

from swarm.core.tls import TLS_NAME

# peers are addressed by IP: every member's certificate names TLS_NAME, and clients check that name
CHANNEL_OPTIONS = [("grpc.ssl_target_name_override", TLS_NAME)]


def channel_credentials(ca_pem: bytes) -> grpc.ChannelCredentials:
    """Trust the run's CA and nothing else (not the system's roots)."""
    return grpc.ssl_channel_credentials(root_certificates=ca_pem)


class ServerTls:
    """A server's TLS key and its current certificate (replaced from another thread when renewed)."""

    def __init__(self, key_pem: bytes, cert_pem: bytes) -> None:
        self.key_pem = key_pem
        self._cert_pem = cert_pem
        self._served: bytes | None = None
        self._lock = threading.Lock()

    @property
    def cert_pem(self) -> bytes:
        with self._lock:
            return self._cert_pem

    def update(self, cert_pem: bytes) -> None:
        with self._lock:
            self._cert_pem = cert_pem

    def _configuration(self, cert_pem: bytes) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key_pem, cert_pem)])

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration only when the certificate changed."""
        with self._lock:
            if self._cert_pem == self._served:
                return None
            self._served = self._cert_pem
            return self._configuration(self._cert_pem)

    def credentials(self) -> grpc.ServerCredentials:
        with self._lock:
            self._served = self._cert_pem
            initial = self._configuration(self._cert_pem)
        return grpc.dynamic_ssl_server_credentials(initial, self._fetch, require_client_authentication=False)
