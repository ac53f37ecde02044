"""``fedefc data`` (docs/OWN-DATA.md, "Preparing a folder of images"): real image files
written with Pillow in several sizes, modes and formats, a corrupt and a non-image file;
the output checked against what the test wrote (counts, class map, pixels computed with
Pillow from the hand-derived crop box, luma and alpha by formula), read back by the
project's own readers unchanged, a class map shared between sites, and every bad input
refused with its value and fix, leaving no output behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.data_files import read_header, read_samples
from common.datasets import load_dataset, task_shape
from common.methods import load_run_config
from common.models import TaskShape
from fedefc_cli.main import main
from fedefc_cli.prepare_data import decode
from fedefc_client.private_data import load_private_data
from tests.helpers import patience

ROOT = Path(__file__).resolve().parents[1]
BICUBIC = Image.Resampling.BICUBIC


def rgb(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def deep_values() -> np.ndarray:
    """16-bit samples 1000 + 128 j, j = 0..255 (both ends present), beyond 8 bits:
    stretched from their own minimum to maximum they are exactly j."""
    j = np.random.default_rng(7).permutation(256).reshape(16, 16)
    return (1000 + 128 * j).astype(np.uint16), j


# the site: relative path -> (Pillow image to save, format, mode as stored, "WxH")
def site_images() -> dict[str, tuple[Image.Image, str, str, str]]:
    alpha = rgb(16, 16, 3)
    rgba = np.dstack([alpha, np.random.default_rng(4).integers(0, 256, (16, 16), np.uint8)])
    return {
        "benign/wide.png": (Image.fromarray(rgb(30, 60, 1)), "PNG", "RGB", "60x30"),
        "benign/tall.jpg": (Image.fromarray(rgb(40, 20, 2)), "JPEG", "RGB", "20x40"),
        "benign/patient7/gray.png": (Image.fromarray(rgb(16, 16, 5)[..., 0]), "PNG", "L",
                                     "16x16"),
        "benign/patient7/alpha.png": (Image.fromarray(rgba), "PNG", "RGBA", "16x16"),
        "malignant/deep.tif": (Image.fromarray(deep_values()[0]), "TIFF", "I;16", "16x16"),
        "malignant/photo.bmp": (Image.fromarray(rgb(24, 24, 6)), "BMP", "RGB", "24x24"),
    }


UNREADABLE = {"README.txt": "not inside a class folder",
              "malignant/broken.jpg": "unreadable", "malignant/notes.txt": "not an image"}


def write_site(root: Path) -> Path:
    for rel, (img, fmt, _, _) in site_images().items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        img.save(root / rel, format=fmt)
    jpeg = root / "malignant" / "broken.jpg"
    Image.fromarray(rgb(32, 32, 8)).save(jpeg, format="JPEG")
    jpeg.write_bytes(jpeg.read_bytes()[:300])  # a truncated download
    (root / "malignant" / "notes.txt").write_text("scanner settings\n")
    (root / "README.txt").write_text("two classes\n")
    (root / "benign" / ".DS_Store").write_bytes(b"\0\1junk")  # hidden: not read
    return root


def order(paths) -> list[str]:
    """The documented order: classes by name, files by path, folder by folder."""
    return sorted(paths, key=lambda p: Path(p).parts)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    base = tmp_path_factory.mktemp("prepare")
    source = write_site(base / "site")
    code = main(["data", str(source), str(base / "out"), "--size", "16",
                 "--classes", "benign,malignant"])
    samples = read_samples(str(base / "out" / "data.npz"), "test")
    return {"code": code, "out": base / "out", "source": source, "samples": samples,
            "files": order(site_images()),
            "summary": json.loads((base / "out" / "summary.json").read_text())}


def test_the_folder_becomes_uint8_images_with_a_class_map_and_counts(prepared):
    assert prepared["code"] == 0
    x, y = prepared["samples"].x, prepared["samples"].y
    files = prepared["files"]
    assert x.shape == (len(files), 3, 16, 16) and x.dtype == np.uint8
    assert y.tolist() == [0 if f.startswith("benign/") else 1 for f in files]
    assert json.loads((prepared["out"] / "classes.json").read_text()) == {"benign": 0,
                                                                        "malignant": 1}
    summary = prepared["summary"]
    assert summary["classes"] == [{"name": "benign", "index": 0, "images": 4},
                                  {"name": "malignant", "index": 1, "images": 2}]
    written = site_images().values()
    for key, column in (("formats", 1), ("modes", 2), ("sizes", 3)):
        expected = {}
        for entry in written:
            expected[entry[column]] = expected.get(entry[column], 0) + 1
        assert summary[key] == expected, key
    skipped = {s["file"]: s["reason"] for s in summary["skipped"]}
    assert set(skipped) == set(UNREADABLE)  # the hidden .DS_Store is not listed
    for file, reason in UNREADABLE.items():
        assert reason in skipped[file]
    assert (summary["input_shape"], summary["num_classes"], summary["images"]) == ("3x16x16",
                                                                                 2, 6)
    assert summary["warnings"] == []


def test_each_row_names_its_file_and_the_data_its_class_names(prepared):
    """data.npz's ``sources``: row n's file relative to SOURCE (so that "row 4" leads to
    an image); ``class_names``: the map's names in index order (the map travels with
    the data)."""
    with np.load(prepared["out"] / "data.npz") as npz:
        assert npz["sources"].tolist() == prepared["files"]
        assert npz["class_names"].tolist() == ["benign", "malignant"]
    x = prepared["samples"].x
    for row, rel in enumerate(prepared["files"]):  # the named file is the row's image
        again = decode(prepared["source"] / rel, 3, (16, 16), "crop")[0]
        np.testing.assert_array_equal(x[row], again)


def test_pixels_match_pillow_with_the_hand_derived_crop_box_luma_and_alpha(prepared):
    x, files = prepared["samples"].x, prepared["files"]
    images = {rel: entry[0] for rel, entry in site_images().items()}

    def out(rel):
        return x[files.index(rel)].transpose(1, 2, 0).astype(int)

    # 60 x 30 to cover 16 x 16: the centred 30 x 30 square, columns 15..45
    wide = images["benign/wide.png"].resize((16, 16), BICUBIC, box=(15, 0, 45, 30))
    np.testing.assert_array_equal(out("benign/wide.png"), np.asarray(wide))
    photo = images["malignant/photo.bmp"].resize((16, 16), BICUBIC)  # square: no crop
    np.testing.assert_array_equal(out("malignant/photo.bmp"), np.asarray(photo))
    gray = np.asarray(images["benign/patient7/gray.png"]).astype(int)
    np.testing.assert_array_equal(out("benign/patient7/gray.png"), np.dstack([gray] * 3))
    rgba = np.asarray(images["benign/patient7/alpha.png"]).astype(float)
    over_black = rgba[..., :3] * rgba[..., 3:] / 255  # alpha onto black, by hand
    assert np.abs(out("benign/patient7/alpha.png") - over_black).max() <= 1
    j = deep_values()[1]  # 16-bit stretched from its own min..max
    np.testing.assert_array_equal(out("malignant/deep.tif"), np.dstack([j] * 3))


def test_the_output_is_read_unchanged_by_npz_imagefolder_and_a_node(prepared):
    data = str(prepared["out"] / "data.npz")
    keys = prepared["summary"]["run_keys"]
    assert keys == {"dataset": "npz", "data-path": data, "num-classes": 2,
                    "input-shape": "3x16x16"}
    for dataset in ("npz", "imagefolder"):
        cfg = load_run_config({**keys, "dataset": dataset, "rho": 0.0, "num-clients": 2})
        loaded = load_dataset(cfg)
        assert (loaded.spec.input_shape, loaded.num_classes) == ((3, 16, 16), 2)
        np.testing.assert_array_equal(loaded.train_x.numpy(), prepared["samples"].x)
        assert task_shape(cfg) == TaskShape((3, 16, 16), 2)
    assert read_header(data, "test") == ((3, 16, 16), 2)
    node = load_private_data(data, TaskShape((3, 16, 16), 2), "node 0")
    assert node.y.tolist() == prepared["samples"].y.tolist()


def test_the_printed_summary_names_counts_skipped_files_and_run_keys(tmp_path, capsys):
    source = write_site(tmp_path / "site")
    assert main(["data", str(source), str(tmp_path / "out"), "--size", "8",
                 "--classes", "malignant,benign"]) == 0
    printed = capsys.readouterr().out
    assert "6 images in 2 classes" in printed
    assert "malignant/broken.jpg: unreadable" in printed and "README.txt" in printed
    assert f"--set data-path={tmp_path / 'out' / 'data.npz'}" in printed
    assert f"--data-path {tmp_path / 'out' / 'data.npz'}" in printed
    assert "--set dataset=npz --set num-classes=2 --set input-shape=3x8x8" in printed


@pytest.mark.parametrize("fit", ["pad", "stretch"])
def test_pad_and_stretch_to_a_non_square_size(tmp_path, fit):
    wide = Image.fromarray(rgb(30, 60, 1))  # 60 x 30 into H 8 x W 12
    for cls in ("a", "b"):
        (tmp_path / "site" / cls).mkdir(parents=True)
        wide.save(tmp_path / "site" / cls / "wide.png")
    assert main(["data", str(tmp_path / "site"), str(tmp_path / "out"), "--size", "8x12",
                 "--fit", fit, "--classes", "a,b"]) == 0
    got = read_samples(str(tmp_path / "out" / "data.npz"), "test").x[0].transpose(1, 2, 0)
    if fit == "stretch":
        expected = np.asarray(wide.resize((12, 8), BICUBIC))
    else:  # 60 x 30 fits 12 x 6, centred: 1 black row above, 1 below
        expected = np.zeros((8, 12, 3), np.uint8)
        expected[1:7] = np.asarray(wide.resize((12, 6), BICUBIC))
    np.testing.assert_array_equal(got, expected)


def test_gray_output_is_the_luma_of_rgb_and_exif_rotation_is_applied(tmp_path):
    colour = rgb(16, 16, 9)
    for cls in ("a", "b"):
        (tmp_path / "site" / cls).mkdir(parents=True)
        Image.fromarray(colour).save(tmp_path / "site" / cls / "c.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    Image.fromarray(rgb(10, 20, 2)).save(tmp_path / "site" / "b" / "turned.jpg", exif=exif)
    assert main(["data", str(tmp_path / "site"), str(tmp_path / "out"), "--size", "16",
                 "--channels", "gray", "--classes", "a,b"]) == 0
    x = read_samples(str(tmp_path / "out" / "data.npz"), "test").x
    assert x.shape == (3, 1, 16, 16)
    luma = colour.astype(float) @ np.array([0.299, 0.587, 0.114])  # ITU-R 601-2
    assert np.abs(x[0, 0] - luma).max() <= 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["sizes"] == {"16x16": 2, "10x20": 1}  # 20 x 10 stored, shown upright


def test_a_decompression_bomb_is_skipped_and_named(tmp_path, monkeypatch):
    tiny_site(tmp_path / "site", ["a", "b"])
    Image.fromarray(rgb(40, 40, 1)).save(tmp_path / "site" / "a" / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 700)  # 40 x 40 > 2 x 700: a "bomb"
    assert main(["data", str(tmp_path / "site"), str(tmp_path / "out"), "--size", "6",
                 "--classes", "a,b"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [s["file"] for s in summary["skipped"]] == ["a/huge.png"]
    assert "DecompressionBombError" in summary["skipped"][0]["reason"]
    assert summary["images"] == 4


def tiny_site(root: Path, classes, per_class: int = 2, seed: int = 0) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rgb(6, 6, seed + 10 * c + i)).save(root / name / f"{i}.png")
    return root


def test_a_second_site_given_the_class_map_gets_the_same_indices(tmp_path, capsys):
    a = tiny_site(tmp_path / "a", ["malignant", "benign", "cyst"])
    assert main(["data", str(a), str(tmp_path / "out-a"), "--size", "6",
                 "--classes", "malignant,benign,cyst"]) == 0
    shared = tmp_path / "out-a" / "classes.json"
    assert json.loads(shared.read_text()) == {"benign": 0, "cyst": 1, "malignant": 2}
    before = shared.read_bytes()
    b = tiny_site(tmp_path / "b", ["malignant"], per_class=3)  # this site lacks two classes
    capsys.readouterr()
    assert main(["data", str(b), str(tmp_path / "out-b"), "--size", "6",
                 "--class-map", str(shared)]) == 0
    assert "absent at this site (in the class map): benign, cyst" in capsys.readouterr().out
    y = read_samples(str(tmp_path / "out-b" / "data.npz"), "test").y
    assert y.tolist() == [2, 2, 2]
    assert (tmp_path / "out-b" / "classes.json").read_bytes() == before == shared.read_bytes()
    summary = json.loads((tmp_path / "out-b" / "summary.json").read_text())
    assert summary["num_classes"] == summary["run_keys"]["num-classes"] == 3
    assert summary["class_map_origin"] == "given"


def test_a_class_missing_from_the_map_is_named_or_extends_it(tmp_path, capsys):
    shared = tmp_path / "classes.json"
    shared.write_text(json.dumps({"benign": 0, "malignant": 1}))
    site = tiny_site(tmp_path / "c", ["benign", "naevus"])
    args = ["data", str(site), str(tmp_path / "out"), "--size", "6", "--class-map", str(shared)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "'naevus'" in err and "--extend-class-map" in err and str(shared) in err
    assert not (tmp_path / "out").exists()
    assert main([*args, "--extend-class-map"]) == 0
    assert json.loads(shared.read_text()) == {"benign": 0, "malignant": 1, "naevus": 2}
    assert read_samples(str(tmp_path / "out" / "data.npz"), "t").y.tolist() == [0, 0, 2, 2]


def test_a_new_class_map_is_written_where_asked_and_numbers_sort_by_value(tmp_path):
    site = tiny_site(tmp_path / "site", [str(i) for i in range(11)], per_class=1)
    target = tmp_path / "shared" / "map.json"
    assert main(["data", str(site), str(tmp_path / "out"), "--size", "6",
                 "--class-map", str(target), "--classes", ",".join(map(str, range(11)))]) == 0
    assert json.loads(target.read_text()) == {str(i): i for i in range(11)}
    assert read_samples(str(tmp_path / "out" / "data.npz"), "t").y.tolist() == list(range(11))


def test_a_first_site_missing_a_class_cannot_shift_the_map(tmp_path, capsys):
    """Issue 49 (4): a first site holding digits 0-9 but 6 wrote a 9-entry map ("7" -> 6,
    num-classes=9) without a word. Now the map comes from the federation's names: without
    them the site is refused, naming the fix; with them "7" is 7, K is 10, class 6 is
    absent here, and a second site with all ten folders given the map written gets the
    same indices (its folder name is its label, as the names are numbers)."""
    digits = [str(d) for d in range(10)]
    a = tiny_site(tmp_path / "a", [d for d in digits if d != "6"], per_class=1)
    shared = tmp_path / "classes.json"
    args = ["data", str(a), str(tmp_path / "out-a"), "--size", "6", "--class-map", str(shared)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "this site's class folders: 0, 1, 2, 3, 4, 5, 7, 8, 9; no folder for 6" in err
    assert "e.g. --classes 0,1,2,3,4,5,6,7,8,9" in err
    assert "--classes 0,1,2,3,4,5,7,8,9" not in err  # issue 60: copied, it shifted the map
    assert not shared.exists() and not (tmp_path / "out-a").exists()
    assert main([*args, "--classes", ",".join(digits)]) == 0
    printed = capsys.readouterr().out
    assert "absent at this site (in the class map): 6" in printed
    assert "--set num-classes=10" in printed
    assert json.loads(shared.read_text()) == {d: int(d) for d in digits}
    assert sorted(read_samples(str(tmp_path / "out-a" / "data.npz"), "t").y.tolist()) == [
        0, 1, 2, 3, 4, 5, 7, 8, 9]
    b = tiny_site(tmp_path / "b", digits, per_class=1, seed=3)
    assert main(["data", str(b), str(tmp_path / "out-b"), "--size", "6",
                 "--class-map", str(shared)]) == 0
    x_b = read_samples(str(tmp_path / "out-b" / "data.npz"), "t")
    for label, pixels in zip(x_b.y.tolist(), x_b.x):  # each image's folder is its label
        folder = b / str(label)
        [png] = folder.iterdir()
        assert np.array_equal(np.asarray(Image.open(png)).transpose(2, 0, 1), pixels)


@pytest.mark.parametrize("given, warned", [
    (["--classes", "one,two,three"], True),  # sorted by name: one = 0, three = 1, two = 2
    (["--classes", "1,2,3"], False),  # digits: sorted by value
    (["--class-map", "{map}"], False),  # words given in the numbers' order
    (["--classes", "benign,cyst,malignant"], False),
])
def test_number_words_out_of_the_numbers_order_are_warned_about(tmp_path, capsys, given,
                                                                warned):
    """Issue 60: with classes "one", "two", "three" sorted by name, label 1 is "three",
    and a steward pressing 1 for "one" wrote a wrong label."""
    names = given[1].split(",") if given[0] == "--classes" else ["one", "two", "three"]
    site = tiny_site(tmp_path / "site", names, per_class=1)
    (tmp_path / "map.json").write_text('{"one": 0, "two": 1, "three": 2}')
    assert main(["data", str(site), str(tmp_path / "out"), "--size", "6",
                 *(a.format(map=tmp_path / "map.json") for a in given)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert ("WARNING: the class names are numbers written as words" in printed) == warned
    assert len(summary["warnings"]) == warned
    if warned:
        assert "(0 = one, 1 = three, 2 = two): label 1 is 'three', not 'one'" in printed


def make_bad(tmp_path: Path, case: str) -> tuple[list[str], list[str]]:
    """(the arguments after ``fedefc data``, what the error must say) of a bad input."""
    src, out = tmp_path / "src", tmp_path / "out"
    if case == "missing":
        return [str(src), str(out), "--size", "8"], [str(src), "does not exist"]
    if case == "file":
        src.write_bytes(b"PK\3\4")
        return [str(src), str(out), "--size", "8"], [str(src), "unpack an archive"]
    if case == "empty":
        src.mkdir()
        return [str(src), str(out), "--size", "8"], [str(src), "is empty", "SOURCE/<class>"]
    if case == "no classes":
        src.mkdir()
        Image.fromarray(rgb(4, 4, 0)).save(src / "a.png")
        return [str(src), str(out), "--size", "8"], ["no class folders, only files (1)",
                                                    "SOURCE/<class>/<image>"]
    if case == "one class":
        tiny_site(src, ["chest_xray"])
        return [str(src), str(out), "--size", "8"], ["'chest_xray'", "point SOURCE at"]
    if case == "splits":
        tiny_site(src / "train", ["a", "b"])
        tiny_site(src / "test", ["a", "b"])
        return [str(src), str(out), "--size", "8"], ["split folders test, train", "--class-map"]
    tiny_site(src, ["a", "b"])
    if case == "out exists":
        out.mkdir()
        (out / "data.npz").write_bytes(b"earlier")
        return [str(src), str(out), "--size", "8"], [str(out), "already exists",
                                                    "choose a new folder"]
    if case == "out inside source":
        return [str(src), str(src / "prepared"), "--size", "8"], ["is inside SOURCE",
                                                                 "outside it"]
    if case == "size":
        return [str(src), str(out), "--size", "64x"], ["--size='64x'", "--size 96x128"]
    if case == "bad json":
        (tmp_path / "m.json").write_text("{benign: 0")
        return ([str(src), str(out), "--size", "8", "--class-map", str(tmp_path / "m.json")],
                [str(tmp_path / "m.json"), "cannot be read", '{"benign": 0, "malignant": 1}'])
    if case == "bad indices":
        (tmp_path / "m.json").write_text('{"a": 0, "b": 2}')
        return ([str(src), str(out), "--size", "8", "--class-map", str(tmp_path / "m.json")],
                ["indices [0, 2]", "0..1, each once"])
    if case == "no class names":  # the map may not come from this site's folders
        return [str(src), str(out), "--size", "8"], [
            "not made from the folders this site happens to hold", "--classes NAME,NAME,...",
            "with the classes this site lacks", "--class-map FILE",
            "this site's class folders: a, b"]
    if case == "map file absent":
        return [str(src), str(out), "--size", "8", "--class-map", str(tmp_path / "m.json")], [
            f"--class-map='{tmp_path / 'm.json'}' does not exist yet: --classes writes it"]
    if case == "classes twice":
        return [str(src), str(out), "--size", "8", "--classes", "a,b,a"], [
            "--classes='a,b,a' has names 'a' more than once", "--classes benign,malignant"]
    if case == "classes and map":
        (tmp_path / "m.json").write_text('{"a": 0, "b": 1}')
        return ([str(src), str(out), "--size", "8", "--classes", "a,b", "--class-map",
                 str(tmp_path / "m.json")], ["--classes and --class-map=", "give one"])
    if case == "folder not in classes":
        return [str(src), str(out), "--size", "8", "--classes", "a,c"], [
            "class folder(s) 'b' are not in the class map --classes (classes: a, c)",
            "add the class to --classes at every site"]
    if case == "extend without map":
        return [str(src), str(out), "--size", "8", "--extend-class-map"], [
            "--extend-class-map needs --class-map"]
    if case == "nothing readable":
        for f in (src / "a").iterdir():
            f.write_bytes(b"not a png")
        for f in (src / "b").iterdir():
            f.write_text("text")
        return [str(src), str(out), "--size", "8", "--classes", "a,b"], [
            "no file in its class folders", "a/0.png: not an image", "PNG, JPEG"]
    assert case == "class without images"
    for f in (src / "b").iterdir():
        f.write_text("text")
    return [str(src), str(out), "--size", "8", "--classes", "a,b"], [
        "class folder 'b' holds no readable image", "b/0.png: not an image",
        "remove the folder"]


BAD = ["missing", "file", "empty", "no classes", "one class", "splits", "out exists",
       "out inside source", "size", "bad json", "bad indices", "extend without map",
       "nothing readable", "class without images", "no class names", "map file absent",
       "classes twice", "classes and map", "folder not in classes"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_exits_2_naming_the_value_and_the_fix_and_writes_nothing(tmp_path, capsys,
                                                                           case):
    args, expected = make_bad(tmp_path, case)
    maps = {p: p.read_bytes() for p in tmp_path.glob("*.json")}
    assert main(["data", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedefc: error: ")
    for text in expected:
        assert text in err, (text, err)
    if case == "out exists":
        assert (tmp_path / "out" / "data.npz").read_bytes() == b"earlier"
    else:
        assert not (tmp_path / "out").exists() and not (tmp_path / "src" / "prepared").exists()
    assert {p: p.read_bytes() for p in tmp_path.glob("*.json")} == maps
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_an_unknown_channel_mode_is_refused_by_the_parser(tmp_path, capsys):
    tiny_site(tmp_path / "src", ["a", "b"])
    with pytest.raises(SystemExit) as exit_:
        main(["data", str(tmp_path / "src"), str(tmp_path / "out"), "--size", "8",
              "--channels", "cmyk"])
    assert exit_.value.code == 2
    assert "invalid choice: 'cmyk'" in capsys.readouterr().err


def test_the_command_line_exits_2_on_bad_input(tmp_path):
    """``python -m fedefc_cli data`` in its own process: the exit code a script sees."""
    site = tiny_site(tmp_path / "site", ["a", "b"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "data.npz").write_bytes(b"earlier")
    done = subprocess.run([sys.executable, "-m", "fedefc_cli", "data", str(site),
                           str(tmp_path / "out"), "--size", "6"],
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=patience(1800))
    assert done.returncode == 2, done.stderr
    assert "fedefc: error: OUT=" in done.stderr and "already exists" in done.stderr
    assert (tmp_path / "out" / "data.npz").read_bytes() == b"earlier"


@pytest.mark.flower
def test_two_prepared_sites_with_one_class_map_train_and_test_through_fedefc_run(tmp_path,
                                                                               capsys):
    """Training images and a test site lacking a class, prepared with the shared class
    map, through a real Flower simulation: the test labels mean the training classes
    (a map made afresh at the test site would call red "1", the training data's green,
    and hold the accuracy at 1/2 or below). What `fedefc run` shows after the last
    round is at most 15 lines (issue 60: 62, 40 of them Flower's History dump); the
    whole log is the out-dir's run.log."""
    colours = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}
    rng = np.random.default_rng(0)
    for site, names, n in (("train", colours, 12), ("test", ("red", "blue"), 4)):
        for name in names:
            (tmp_path / site / name).mkdir(parents=True)
            for i in range(n):
                noisy = np.array(colours[name]) + rng.normal(0, 40, (20, 30, 3))
                img = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
                img.save(tmp_path / site / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    assert main(["data", str(tmp_path / "train"), str(tmp_path / "p-train"), "--size", "8",
                 "--classes", "red,green,blue"]) == 0
    assert main(["data", str(tmp_path / "test"), str(tmp_path / "p-test"), "--size", "8",
                 "--class-map", str(tmp_path / "p-train" / "classes.json")]) == 0
    keys = json.loads((tmp_path / "p-train" / "summary.json").read_text())["run_keys"]
    tiny = {"test-path": tmp_path / "p-test" / "data.npz", "model": "cnn", "rho": 0,
            "num-clients": 2, "fraction": 1.0, "rounds": 2, "local-epochs": 1,
            "batch-size": 8, "iid": "true", "start-round": 1, "gamma-thr": 1,
            "client-threads": 1, "accuracy-signal": "global"}
    sets = [f"--set={k}={v}" for k, v in {**keys, **tiny}.items()]
    capsys.readouterr()
    assert main(["run", *sets, "--out-dir", str(tmp_path / "run")]) == 0
    shown = capsys.readouterr().out.splitlines()
    closing = shown[max(i for i, line in enumerate(shown) if "[round 2/2]" in line) + 1:]
    assert len(closing) <= 15 and closing[-1].startswith("  files: "), "\n".join(closing)
    kept = (tmp_path / "run" / "run.log").read_text()
    assert "[round 2/2]" in kept and "SUMMARY |" in kept and "History" not in kept
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["num_classes"], summary["input_shape"]) == (3, [3, 8, 8])
    assert (summary["train_samples"], summary["rounds"]) == (36, 2)
    assert summary["accuracy_source"] == "server test set" and summary["final_acc"] >= 0.75


def samples(npz: Path) -> list[tuple[int, bytes]]:
    """An .npz's (label, pixels) pairs in a canonical order: its contents as a multiset."""
    data = np.load(npz)
    return sorted((int(y), x.tobytes()) for x, y in zip(data["images"], data["labels"]))


def test_exported_image_folders_prepare_back_to_the_partitions(tmp_path, capsys):
    """``fedefc deploy export --images`` writes each partition as PNG files in class
    folders with one class map; ``fedefc data`` with that map, at the data's own size and
    channels, gives every node exactly the samples and noisy labels of its partition, the
    .npz that ``fedefc deploy export`` writes (docs/DEPLOYMENT.md's one-machine block)."""
    sets = ["--set", "num-clients=2"]
    assert main(["deploy", "export", str(tmp_path / "npz"), *sets]) == 0
    assert main(["deploy", "export", str(tmp_path / "img"), "--images", *sets]) == 0
    class_map = tmp_path / "img" / "classes.json"
    assert json.loads(class_map.read_text()) == {str(c): c for c in range(10)}
    for k in range(2):
        folder = tmp_path / "img" / f"node-{k}"
        assert all(p.suffix == ".png" for p in folder.rglob("*") if p.is_file())
        assert main(["data", str(folder), str(tmp_path / "data" / f"node-{k}"), "--size", "28",
                     "--channels", "gray", "--class-map", str(class_map)]) == 0
        assert samples(tmp_path / "data" / f"node-{k}" / "data.npz") == \
            samples(tmp_path / "npz" / f"node-{k}" / "data.npz")
    assert main(["deploy", "export", str(tmp_path / "img"), "--images", *sets]) == 2
    assert "classes.json already exist" in capsys.readouterr().err


def test_export_refuses_images_of_a_dataset_without_images(tmp_path, capsys):
    """Features are no images: --images names the dataset and the way without it, and
    writes nothing."""
    data = tmp_path / "features.npz"
    rng = np.random.default_rng(0)
    np.savez(data, features=rng.normal(size=(40, 6)).astype(np.float32),
             labels=np.arange(40) % 4)
    sets = ["--set", 'dataset="npz"', "--set", f'data-path="{data}"', "--set", "num-clients=2",
            "--set", "iid=true", "--set", "zeta=0.4"]
    assert main(["deploy", "export", str(tmp_path / "img"), "--images", *sets]) == 2
    assert not (tmp_path / "img").exists()  # refused before anything is written
    err = capsys.readouterr().err
    assert "dataset='npz' holds no 8-bit gray or RGB images (samples of shape (6,))" in err
    assert "export it without --images" in err


def test_the_prepared_data_is_owner_only_unless_asked_otherwise(tmp_path):
    """Issue 29 (5): ``fedefc data`` wrote the decoded images and labels 0644 in a 0755
    folder, readable by every user of the machine. Now, under the usual umask 022, the
    output folder (and a parent it creates) is 0700 and every file in it 0600;
    ``--readable-by-others`` gives the container case 0644 / 0755."""
    old = os.umask(0o022)
    try:
        source = write_site(tmp_path / "site")
        classes = ["--classes", "benign,malignant"]
        assert main(["data", str(source), str(tmp_path / "new" / "out"), "--size", "8",
                     *classes]) == 0
        assert main(["data", str(source), str(tmp_path / "shared"), "--size", "8",
                     "--readable-by-others", *classes]) == 0
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    out = tmp_path / "new" / "out"
    assert (mode(tmp_path / "new"), mode(out)) == (0o700, 0o700)
    assert {f.name: mode(f) for f in out.iterdir()} == {
        "data.npz": 0o600, "classes.json": 0o600, "summary.json": 0o600}
    assert mode(tmp_path / "shared") == 0o755
    assert mode(tmp_path / "shared" / "data.npz") == 0o644
