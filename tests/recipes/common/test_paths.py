"""recipes.common.paths: where --data-dir auto looks, and the cache folder."""

from pathlib import Path

from recipes.common import paths
from recipes.common.paths import data_dir_candidates, default_data_dir

REPOSITORY = Path(__file__).resolve().parents[3]


def test_the_shared_data_folder_is_beside_the_repository_not_inside_it():
    assert REPOSITORY.parent / "shared" / "data" == paths.SHARED_DATA


def test_the_shared_copy_wins_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "SHARED_DATA", tmp_path / "shared")
    (tmp_path / "shared" / "cifar10").mkdir(parents=True)
    assert default_data_dir("cifar10") == tmp_path / "shared" / "cifar10"


def test_without_a_shared_copy_it_is_data_name_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "SHARED_DATA", tmp_path / "absent")
    (tmp_path / "absent").mkdir()  # the shared folder without this data set
    assert default_data_dir("cifar10") == Path("data/cifar10")
    assert data_dir_candidates("cifar10") == (tmp_path / "absent" / "cifar10",
                                              Path("data/cifar10"))


def test_the_cache_is_the_variables_folder_else_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("IGNITE_ENGINE_CACHE", str(tmp_path / "mine"))
    assert paths.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("IGNITE_ENGINE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_root() == tmp_path / "xdg" / "ignite-engine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.cache_root() == Path.home() / ".cache" / "ignite-engine"
