"""The bearer-token check of RolloutService: the scheme is case-insensitive (as HTTP
auth schemes are); the token is not."""

from __future__ import annotations

import pytest

from services.common.security import BearerTokenAuth


@pytest.mark.parametrize("value,ok", [
    ("Bearer s3cret", True), ("bearer s3cret", True), ("BEARER s3cret", True), ("Bearer  s3cret", True),
    ("Bearer S3CRET", False), ("Basic s3cret", False), ("Bearers3cret", False), ("Bearer ", False),
    ("s3cret", False),
])
def test_the_scheme_is_case_insensitive_and_the_token_exact(value, ok):
    auth = BearerTokenAuth(["s3cret"], ["rhymerl.v1.RolloutService"])
    assert auth._authorized([("authorization", value)]) is ok
    assert auth._authorized([("x-other", "Bearer s3cret")]) is False
