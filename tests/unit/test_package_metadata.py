"""Both pyproject.toml files declare the license as an SPDX expression (``license = "..."``): the
``{ text = ... }`` table is deprecated and setuptools refuses it after 2027-02-18. The wheel
built from the client's file carries it as ``License-Expression`` (test_client_package.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["pyproject.toml", "client/pyproject.toml"])
def test_license_is_an_spdx_string_and_setuptools_can_read_it(path):
    data = tomllib.loads((ROOT / path).read_text())
    assert data["project"]["license"] == "Apache-2.0"
    for f in data["project"].get("license-files", []):
        assert list((ROOT / path).parent.glob(f)), f"license-files {f!r} matches nothing"
    # the SPDX string form needs setuptools >= 77
    (req,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(map(int, re.search(r">=\s*([\d.]+)", req).group(1).split(".")))[:1] >= (77,)
