"""recipes.common.image_files: the one listing of image-folder trees both image recipes use."""

import os

import numpy as np
import pytest
import torch
from PIL import Image

from recipes.common.image_files import (
    IMAGE_SUFFIXES,
    class_names,
    list_class_folder,
    read_image,
)
from recipes.runner.config.command_line import DataError


def test_every_suffix_either_recipe_accepted_is_an_image_in_any_case(tmp_path):
    names = ["a.jpg", "b.JPEG", "c.Png", "d.bmp", "e.gif", "f.WEBP", "g.tif", "h.tiff",
             "i.txt", "README.md", "j.jpg.bak"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    images, others = list_class_folder(tmp_path)
    assert [os.path.basename(path) for path in images] == names[:8]
    assert [os.path.basename(path) for path in others] == ["README.md", "i.txt", "j.jpg.bak"]
    assert {".jpg", ".jpeg", ".png"} <= set(IMAGE_SUFFIXES)  # CIFAR's own list, kept


def test_files_are_sorted_by_name_and_hidden_entries_left_out(tmp_path):
    for name in ["10.png", "2.png", "B.png", "a.png", ".hidden.png", ".DS_Store"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "folder.png").mkdir()  # an image name on a folder: not an image
    images, others = list_class_folder(str(tmp_path))
    assert images == [str(tmp_path / name) for name in ["10.png", "2.png", "B.png", "a.png"]]
    assert others == [str(tmp_path / "folder.png")]


def test_a_folder_without_images_is_a_data_error_naming_it_and_the_suffixes(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / ".hidden.jpg").write_bytes(b"")
    with pytest.raises(DataError, match=f"no images \\(.jpg .jpeg .png .*\\) in the class "
                                        f"folder {tmp_path}$"):
        list_class_folder(tmp_path)


def test_an_image_name_that_leads_to_no_file_is_an_error_at_listing(tmp_path):
    (tmp_path / "good.png").write_bytes(b"")
    (tmp_path / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(DataError, match=f"cannot read image {tmp_path / 'gone.png'}"):
        list_class_folder(tmp_path)


def test_class_names_are_the_sorted_visible_folders(tmp_path):
    for name in ["dog", "Cat", "ant", ".cache"]:
        (tmp_path / name).mkdir()
    (tmp_path / "labels.csv").write_text("")
    assert class_names(tmp_path) == ["Cat", "ant", "dog"]


@pytest.mark.parametrize("suffix", [".bmp", ".tiff", ".png"])
def test_read_image_gives_exact_rgb_pixels_of_lossless_formats(tmp_path, suffix):
    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3)).astype(np.uint8)
    path = tmp_path / f"image{suffix}"
    Image.fromarray(pixels).save(path)
    image = read_image(path)
    assert image.dtype == torch.uint8 and image.shape == (3, 5, 7)
    assert torch.equal(image, torch.from_numpy(pixels).permute(2, 0, 1))
