"""Credentials never leak: not from a URI (refused, shown redacted), not from the environment
(no error message, log line or written object carries the secret).  The Ray runs of
``test_s3_faults.py`` check their objects, output and Ray's session logs the same way."""

from __future__ import annotations

import logging

import pytest

from prepack.cli import main
from schemas.config_file import load_config
from schemas.errors import CredentialsInUri
from schemas.location import resolve_location
from tests.helpers import datagen as dg
from tests.helpers.packs import pack_in_process, small_dataset
from tests.helpers.s3checks import secret_leaks

pytestmark = pytest.mark.slow  # needs the S3 server (started once per session)

URI_SECRET = "uRiSeCrEt0123456789"


def _cli(capfd, caplog, *argv: str) -> tuple[int, str]:
    """Run the CLI in this process; return its exit code and everything it printed or logged."""
    with caplog.at_level(logging.DEBUG):
        rc = main(list(argv))
    out, err = capfd.readouterr()
    return rc, out + err + caplog.text


@pytest.mark.parametrize("uri", [f"s3://AKIDEXAMPLE:{URI_SECRET}@bucket/pack",
                                 f"s3://bucket/pack?region=us-east-1&secret_key={URI_SECRET}"])
def test_credentials_in_a_uri_are_refused_and_redacted(uri, capfd, caplog, tmp_path):
    with pytest.raises(CredentialsInUri) as e:
        resolve_location(uri)
    assert URI_SECRET not in str(e.value) and "***" in str(e.value)
    for argv in (["verify", uri], ["stats", uri]):
        rc, text = _cli(capfd, caplog, *argv)
        assert rc == 2 and "carries credentials" in text and URI_SECRET not in text, text
    ds = dg.Dataset(str(tmp_path))
    ds.groups["t2i_pretrain"] = {"dataset_names": ["t"], "image_transform_args": dict(dg.VAE_ARGS),
                                 "num_used_data": [1], "weight": 1.0}
    ds.info["t2i_pretrain"] = {"t": {"data_dir": uri}}
    with pytest.raises(CredentialsInUri) as e:
        load_config(ds.config())
    assert URI_SECRET not in str(e.value)


def test_environment_secret_never_printed_or_written(s3, capfd, caplog, tmp_path, tokenizer_and_special, monkeypatch):
    config = small_dataset(str(tmp_path), batches=2)
    uri = s3.new_prefix("secrets")
    with caplog.at_level(logging.DEBUG):
        pack_in_process(config, uri, tokenizer_and_special)
    texts = {"pack": caplog.text}
    runs = [["verify", uri], ["verify", f"{uri}-missing"], ["run", config, "--out", "s3://no-such-bucket-x/p"]]
    for argv in runs:
        texts[" ".join(argv)] = _cli(capfd, caplog, *argv)[1]
    assert "prepack: error:" in texts[f"verify {uri}-missing"]
    assert "prepack: error: cannot write to s3://no-such-bucket-x/p" in texts[" ".join(runs[2])]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + s3.secret_key)  # refused by the server
    rc, texts["wrong secret"] = _cli(capfd, caplog, "verify", uri)
    assert rc != 0
    # the wrong secret contains the right one: echoing either is caught
    assert secret_leaks(s3.secret_key, s3.objects(uri), texts) == []
