"""Secret files (security.secret.read_private_file, ClusterSecret.load) on a real filesystem: the
path's final target is what is checked, on the descriptor it is read from; a `..data` in a
path grants nothing unless the file really sits in a Kubernetes Secret volume's layout on a
tmpfs, owned by root."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from pdserve.security.secret import ClusterSecret, ClusterSecretError, read_private_file

SHM = Path("/dev/shm")


def write(path: Path, mode: int, data: bytes = b"0123456789abcdef0123456789abcdef\n") -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def secret_volume(root: Path, mode: int) -> Path:
    """What the kubelet writes for a Secret volume: ..<timestamp>/key, ..data -> it, key -> ..data/key."""
    stamped = root / "..2026_11_25_19_30_00.123456789"
    stamped.mkdir(parents=True)
    write(stamped / "cluster-secret", mode)
    os.symlink(stamped.name, root / "..data")
    os.symlink("..data/cluster-secret", root / "cluster-secret")
    return root / "cluster-secret"


@pytest.fixture
def shm_dir():
    if not SHM.is_dir():
        pytest.skip("no /dev/shm tmpfs")
    path = SHM / f"pdserve-test-{secrets.token_hex(6)}"
    path.mkdir()
    yield path
    for child in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
        child.unlink() if child.is_symlink() or child.is_file() else child.rmdir()
    path.rmdir()


def test_a_private_file_is_read(tmp_path):
    assert ClusterSecret.load(write(tmp_path / "s", 0o600))
    assert ClusterSecret.load(write(tmp_path / "r", 0o400))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_group_or_world_access_is_refused(tmp_path, mode):
    with pytest.raises(ClusterSecretError, match="readable by others"):
        ClusterSecret.load(write(tmp_path / "s", mode))


def test_a_data_component_anywhere_grants_nothing(tmp_path):
    """Before: any resolved path with a `..data` part skipped the mode check."""
    folder = tmp_path / "..data"
    folder.mkdir()
    with pytest.raises(ClusterSecretError, match="readable by others"):
        ClusterSecret.load(write(folder / "s", 0o644))


def test_a_symlink_is_judged_by_its_target(tmp_path):
    target = write(tmp_path / "shared", 0o644)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(ClusterSecretError, match="via"):
        ClusterSecret.load(tmp_path / "link")


def test_the_kubernetes_layout_is_accepted_only_on_a_tmpfs_and_never_writable(shm_dir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the kubelet's files are root's; this needs to run as root")
    assert ClusterSecret.load(secret_volume(shm_dir / "chart", 0o440))  # the chart's defaultMode
    assert ClusterSecret.load(secret_volume(shm_dir / "default", 0o644))  # Kubernetes' default
    with pytest.raises(ClusterSecretError, match="readable by others"):
        ClusterSecret.load(secret_volume(shm_dir / "writable", 0o666))
    with pytest.raises(ClusterSecretError, match="readable by others"):
        ClusterSecret.load(secret_volume(tmp_path / "on-disk", 0o644))  # same layout, not a tmpfs


def test_a_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path = write(tmp_path / "s", 0o600)
    os.chown(path, 4242, 4242)
    with pytest.raises(ClusterSecretError, match="uid 4242"):
        ClusterSecret.load(path)


def test_only_regular_files_are_read_and_a_fifo_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(ClusterSecretError, match="not a regular file"):
        read_private_file(tmp_path / "fifo", "test")
    with pytest.raises(ClusterSecretError, match="cannot read"):
        read_private_file(tmp_path / "missing", "test")


def test_an_internal_tls_key_others_may_read_is_refused(tmp_path):
    from pdserve.rpc.credentials import InternalTLS

    cert, ca = write(tmp_path / "cert.pem", 0o644, b"cert"), write(tmp_path / "ca.pem", 0o644, b"ca")
    with pytest.raises(ClusterSecretError, match="internal TLS key .* readable by others"):
        InternalTLS.load(str(cert), str(write(tmp_path / "key.pem", 0o644, b"key")), str(ca))
    tls = InternalTLS.load(str(cert), str(write(tmp_path / "private.pem", 0o600, b"key")), str(ca))
    assert (tls.cert, tls.key, tls.ca) == (b"cert", b"key", b"ca")
