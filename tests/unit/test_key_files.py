"""Keys read from files (issue 48, item 7: the chart passed the API key, the Redis password
and the metrics token as environment variables): a worker's --metrics-token-file,
--redis-url-file and --redis-password-file, each a private file (or a Secret volume's),
become the settings they stand for; a file others can read, or a key given twice, stops the
start with the reason."""
from __future__ import annotations

import pytest

from pdserve.worker.settings import SettingsError, WorkerSettings


def key_file(path, text: str, mode: int = 0o600) -> str:
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def test_a_workers_metrics_token_and_redis_password_come_from_files(tmp_path):
    s = WorkerSettings.from_settings("decode", {
        "metrics_token_file": key_file(tmp_path / "token", "scrape-5e1"),
        "redis_url": "redis://pdserve-redis:6379/0",
        "redis_password_file": key_file(tmp_path / "password", "p@ss/w:rd"),
    })
    assert s.metrics_token == "scrape-5e1"
    assert s.redis_url == "redis://:p%40ss%2Fw%3Ard@pdserve-redis:6379/0"
    assert s.transfer_config().redis_url == s.redis_url


def test_a_redis_url_with_its_password_comes_from_a_file(tmp_path):
    url = "rediss://:secret@redis.example:6380/2"
    s = WorkerSettings.from_settings("prefill", {"redis_url_file": key_file(tmp_path / "url", url)})
    assert s.redis_url == url


def test_an_enrollment_token_comes_from_a_file_and_is_what_the_router_checks(tmp_path):
    """A worker's own enrollment token from a file (what an enrolling init container writes
    into a memory volume): the router's verifier accepts it for that worker, role and host."""
    from pdserve.security.enrollment import EnrollmentIssuer, EnrollmentVerifier

    issuer = EnrollmentIssuer()
    token = issuer.issue("decode-7f9c", "decode", "10.0.0.7")
    s = WorkerSettings.from_settings("decode", {"enrollment_token_file": key_file(tmp_path / "token", token)})
    assert s.enrollment_token == token
    EnrollmentVerifier(issuer.public_key).check(s.enrollment_token, "decode-7f9c", "decode", "10.0.0.7:50070")
    with pytest.raises(SettingsError, match="give one"):
        WorkerSettings.from_settings("decode", {"enrollment_token": token, "enrollment_token_file": str(tmp_path / "token")})


@pytest.mark.parametrize("settings, match", [
    ({"metrics_token": "a", "metrics_token_file": "F"}, "give one"),
    ({"redis_url": "redis://h:1/0", "redis_url_file": "F"}, "give one"),
    ({"redis_url": "redis://:x@h:1/0", "redis_password_file": "F"}, "without a password"),
    ({"redis_password_file": "F"}, "without a password"),
])
def test_a_key_given_twice_stops_the_start(tmp_path, settings, match):
    path = key_file(tmp_path / "f", "k")
    with pytest.raises(SettingsError, match=match):
        WorkerSettings.from_settings("decode", {k: (path if v == "F" else v) for k, v in settings.items()})


def test_a_key_file_others_can_read_stops_the_start(tmp_path):
    with pytest.raises(SettingsError, match="readable by others"):
        WorkerSettings.from_settings("decode", {"metrics_token_file": key_file(tmp_path / "t", "k", 0o644)})
