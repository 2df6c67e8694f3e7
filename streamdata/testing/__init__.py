"""Real local storage servers for tests, benchmarks and demos (see :mod:`.http`)."""

from .http import (
    GCSServer,
    HTTPServer,
    S3Endpoint,
    S3Server,
    ServerError,
    free_port,
    gcs_from_env,
    main,
    s3_from_env,
)

__all__ = [
    "GCSServer",
    "HTTPServer",
    "S3Endpoint",
    "S3Server",
    "ServerError",
    "free_port",
    "gcs_from_env",
    "s3_from_env",
]
