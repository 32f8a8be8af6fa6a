"""The native kernels' cache loads only what this user built: a library or folder that someone
else owns or can write, or a link, is refused with a message naming it, before anything is
loaded (`available()` then falls back to the pure-JAX references)."""

from __future__ import annotations

import os

import pytest

from kernels_pallas import native


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "native"
    monkeypatch.setenv(native.CACHE_ENV, str(folder))
    return folder


def planted(folder, mode: int = 0o755):
    """A file where the matmul library would be cached; nothing that could load."""
    folder.mkdir(mode=0o700, exist_ok=True)
    path = native._library_path("matmul", "native")[0]
    path.write_bytes(b"not a library")
    os.chmod(path, mode)
    return path


def test_a_folder_others_can_write_is_refused(cache):
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.raises(RuntimeError, match=rf"{cache} can be written by group or others"):
        native.build("matmul")


def test_a_library_others_can_write_is_refused(cache):
    path = planted(cache, 0o666)
    with pytest.raises(RuntimeError, match=rf"{path} can be written by group or others"):
        native.build("matmul")


def test_a_link_in_place_of_a_library_is_refused(cache, tmp_path):
    path = planted(cache)
    elsewhere = tmp_path / "elsewhere.so"
    os.replace(path, elsewhere)
    os.symlink(elsewhere, path)
    with pytest.raises(RuntimeError, match=rf"{path} is not a plain library"):
        native.build("matmul")


def test_a_library_someone_else_owns_is_refused(cache):
    path = planted(cache)
    if os.geteuid() == 0:  # root can hand the file to another user
        os.chown(path, 54321, -1)
        with pytest.raises(RuntimeError, match=r"is owned by uid 54321, not this user"):
            native.build("matmul")
    else:  # anyone else finds a folder root made
        path.unlink()
        os.rmdir(cache)
        os.symlink("/", cache)
        with pytest.raises(RuntimeError, match=r"is not a plain folder|is owned by uid 0"):
            native.build("matmul")


def test_a_private_library_of_the_right_name_is_used_as_found(cache):
    path = planted(cache)
    assert native.build("matmul") == path  # not rebuilt: found, and its checks pass
    assert path.read_bytes() == b"not a library"
