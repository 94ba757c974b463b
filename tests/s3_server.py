"""A real S3 endpoint on loopback for tests: moto's threaded server and one fresh bucket.

Registered for every test by `tests/conftest.py`; use it by naming the fixture:

    def test_upload(s3_endpoint):
        store = ObjectStore(root=s3_endpoint.root("prefix"), endpoint_url=s3_endpoint.url)

The fixture sets dummy AWS credentials and region in the environment for the
module's duration and points the AWS config files nowhere, so no test can
reach a real account.
"""

from __future__ import annotations

import dataclasses
import urllib.request
import uuid
from typing import Any, Iterator

import pytest


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """A running S3-compatible endpoint and a bucket created on it.

    Attributes:
        url: Endpoint URL, e.g. `http://127.0.0.1:53211`.
        bucket: Name of an empty bucket created for this test module.
    """

    url: str
    bucket: str

    def root(self, *parts: str) -> str:
        """`s3://<bucket>/<parts...>`."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts if p)])

    def client(self) -> Any:
        """A boto3 S3 client talking to this endpoint."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """Start moto's S3 server on a free loopback port with one fresh bucket; stop it afterwards."""
    from moto.server import ThreadedMotoServer

    empty = tmp_path_factory.mktemp("aws") / "none"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(empty))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
        for name in (
            "AWS_SESSION_TOKEN",
            "AWS_SECURITY_TOKEN",
            "AWS_PROFILE",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
        ):
            mp.delenv(name, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = S3Endpoint(url=f"http://{host}:{port}", bucket=f"trainyard-test-{uuid.uuid4().hex[:12]}")
            endpoint.client().create_bucket(Bucket=endpoint.bucket)
            yield endpoint
            # moto keeps its state per process, not per server: drop it so the
            # next module starts from an empty account.
            urllib.request.urlopen(urllib.request.Request(f"{endpoint.url}/moto-api/reset", method="POST"), timeout=10)
        finally:
            server.stop()
