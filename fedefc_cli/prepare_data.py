"""``fedefc data``: a folder of images of any size and format, one sub-folder per class,
turned into a node's data (docs/OWN-DATA.md, "Preparing a folder of images").

    SOURCE/<class name>/**/<image>  ->  OUT/data.npz      uint8 images (N, C, H, W), labels,
                                                          each row's file (``sources``) and
                                                          the class names (``class_names``)
                                        OUT/classes.json  the class map used: {name: index}
                                        OUT/summary.json  what was found, read and skipped

``data.npz`` is the format of :mod:`common.data_files`, read unchanged with
``dataset = "npz"`` (or ``"imagefolder"``, whose reader takes an .npz too) and by a
SuperNode's ``--data-path``.

- Classes: each folder directly under SOURCE is a class; its images are gathered from it
  and every folder beneath it (e.g. one folder per patient). Files directly under SOURCE
  and hidden files and folders are not read (the former are named in the summary).
- Class map: ``{class name: index}``, indices 0..K-1, fixed by the names every site
  shares, never by the folders one site happens to hold (a first site that lacks class
  "6" would otherwise number "7" as 6 and tell the run K = 9): the federation's class
  names given up front (``--classes a,b,c``: indices in their sorted order, by value
  when every name is a number), or the federation's map file (``--class-map FILE``,
  when it exists). Without either the command refuses, naming this site's folders. The
  map is written to OUT/classes.json, and to FILE when ``--classes`` makes it there. A
  folder the map does not name is an error, or gets the next index with
  ``--extend-class-map``, which rewrites FILE; a class of the map without a folder is
  absent at this site (listed, K unchanged). ``data.npz`` carries the map's names in
  index order (``class_names``), and each row's file relative to SOURCE (``sources``),
  so that a row can be traced to its image. Names that are all numbers, some written as
  words ("one", "two"), whose indices do not follow their values get a warning
  (:func:`number_order_warning`): "label 1" would not be "one".
- Pixels (:func:`decode`): EXIF rotation applied; images of more than 8 bits per sample
  (16-bit PNG or TIFF, 32-bit integer or float TIFF) stretched from their own minimum to
  their own maximum onto 0..255; transparency composited onto black; then converted to
  grayscale (ITU-R 601-2 luma, Pillow's ``L``) or RGB; the first frame of an animation.
- Size (:func:`resize`), with Pillow's bicubic filter (antialiased when shrinking):
  ``crop`` scales the image to cover H x W and cuts the centre (``ImageOps.fit``);
  ``pad`` scales it to fit inside and pads with black, centred (``ImageOps.pad``);
  ``stretch`` resizes to H x W, ignoring the aspect ratio.
- A file Pillow cannot read (not an image, truncated, corrupt) is skipped and named with
  its reason. Bad input raises :class:`PrepareError` (exit 2) naming the value and the
  fix, before OUT exists: OUT appears complete or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import unicodedata
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError  # Pillow comes with torchvision

from common.data_files import shape_text
from common.private_files import DIR_MODE, FILE_MODE, make_private_dir, open_private
from common.results import atomic_write_bytes, atomic_write_json

from .errors import UsageError

FITS = ("crop", "pad", "stretch")
CHANNELS = {"gray": 1, "rgb": 3}
# names of split folders: SOURCE/train/<class>/... is a layout one level too high
SPLIT_NAMES = {"train", "training", "test", "testing", "val", "valid", "validation"}
PROGRESS_EVERY = 1000
# what Pillow's decoders raise on a file that is not an image or is damaged (a truncated
# or corrupt stream, a header that lies, a decompression bomb); other errors propagate
DAMAGED = (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error,
           Image.DecompressionBombError)


class PrepareError(UsageError):
    """The folder, the class map or a flag of ``fedefc data`` is unusable; the message
    names it and the fix."""


@dataclass
class Found:
    """What the folder held: per class the readable images, and what was seen or
    skipped."""

    counts: Counter = field(default_factory=Counter)  # class name -> images read
    formats: Counter = field(default_factory=Counter)  # "PNG" -> images
    modes: Counter = field(default_factory=Counter)  # Pillow mode as stored -> images
    sizes: Counter = field(default_factory=Counter)  # "WxH" -> images
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)


def parse_size(text: str) -> tuple[int, int]:
    """``"64"`` -> (64, 64); ``"96x128"`` -> (96, 128): (height, width) in pixels, as in
    ``input-shape``'s ``CxHxW``."""
    parts = text.lower().split("x")
    if len(parts) in (1, 2) and all(p.strip().isdigit() and int(p) > 0 for p in parts):
        h, w = int(parts[0]), int(parts[-1])
        return h, w
    raise PrepareError(f"--size={text!r} is not a size; write N for N x N pixels or HxW "
                       "(height x width), e.g. --size 64 or --size 96x128")


NUMBER_WORDS = {word: value for value, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}


def number_value(name: str) -> int | None:
    """The number a class name says, in digits ("7") or an English word ("seven", any
    case); None for any other name."""
    text = name.strip()
    if text.isdigit():
        return int(text)
    return NUMBER_WORDS.get(text.lower())


def number_order_warning(mapping: dict[str, int]) -> str | None:
    """A warning when every class name is a number, one at least written as a word, and
    the indices do not follow the numbers (``--classes one,two,three`` sorts by name:
    one = 0, three = 1, two = 2): a steward, a script or a report reading label 1 as
    "one" would be wrong. None otherwise."""
    values = {name: number_value(name) for name in mapping}
    if any(v is None for v in values.values()) or all(n.strip().isdigit() for n in mapping):
        return None
    by_index = sorted(mapping, key=mapping.get)
    if [values[n] for n in by_index] == sorted(values.values()):
        return None
    shown = ", ".join(f"{mapping[n]} = {n}" for n in by_index[:4])
    misread = next((f": label {values[n]} is {by_index[values[n]]!r}, not {n!r}"
                    for n in sorted(mapping, key=values.get)
                    if values[n] < len(by_index) and mapping[n] != values[n]), "")
    return (f"the class names are numbers written as words, but their indices do not follow "
            f"the numbers ({shown}{', ...' if len(by_index) > 4 else ''}){misread}. Keep "
            "this map at every site if the federation already uses it; otherwise give a "
            "map in the numbers' order (--class-map FILE holding, e.g., "
            '{"one": 0, "two": 1, "three": 2})')


def natural_order(names: list[str]) -> list[str]:
    """Sorted by name, or by value when every name is a number (so that folders 0..K-1
    keep their numbers as indices)."""
    if all(name.isdigit() for name in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


def class_folders(source: Path) -> tuple[dict[str, Path], list[Path]]:
    """{class name: folder} of the folders directly under ``source``, and the files
    lying directly under it (not in a class folder)."""
    if not source.exists():
        raise PrepareError(f"SOURCE={str(source)!r} does not exist; give the folder that holds "
                           "one sub-folder of images per class")
    if not source.is_dir():
        raise PrepareError(f"SOURCE={str(source)!r} is a file, not a folder; give the folder "
                           "that holds one sub-folder of images per class (unpack an archive "
                           "first)")
    entries = [p for p in source.iterdir() if not p.name.startswith(".")]
    folders = {unicodedata.normalize("NFC", p.name): p for p in entries if p.is_dir()}
    loose = sorted(p for p in entries if not p.is_dir())
    if not entries:
        raise PrepareError(f"SOURCE={str(source)!r} is empty; put each class's images in a "
                           "folder named after the class: SOURCE/<class>/<image>")
    if not folders:
        raise PrepareError(f"SOURCE={str(source)!r} has no class folders, only files "
                           f"({len(loose)}); put each class's images in a folder named after the "
                           "class: SOURCE/<class>/<image>")
    return folders, loose


def read_class_map(path: Path) -> dict[str, int]:
    """A class map file: a JSON object {class name: index} with indices 0..K-1."""
    fix = ("write it as a JSON object of class names and indices 0..K-1, e.g. "
           '{"benign": 0, "malignant": 1}, or give the classes.json another site\'s '
           "fedefc data wrote")
    if path.is_dir():
        raise PrepareError(f"--class-map={str(path)!r} is a folder; give the class map file "
                           "(e.g. the classes.json that fedefc data wrote)")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PrepareError(f"--class-map={str(path)!r} cannot be read ({err}); {fix}") from None
    if not isinstance(loaded, dict) or not loaded or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in loaded.values()):
        raise PrepareError(f"--class-map={str(path)!r} is not a non-empty object of class "
                           f"names and integer indices; {fix}")
    indices = sorted(loaded.values())
    if indices != list(range(len(loaded))):
        raise PrepareError(f"--class-map={str(path)!r} has the indices {indices}; they must be "
                           f"0..{len(loaded) - 1}, each once; {fix}")
    return {unicodedata.normalize("NFC", name): index for name, index in loaded.items()}


def parse_classes(text: str) -> list[str]:
    """``--classes``: the federation's class names, comma-separated, each once."""
    names = [unicodedata.normalize("NFC", n.strip()) for n in text.split(",")]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if any(not n for n in names) or repeated or len(names) < 2:
        why = (f"names {', '.join(map(repr, repeated))} more than once" if repeated else
               "an empty name" if any(not n for n in names) else "fewer than two classes")
        raise PrepareError(f"--classes={text!r} has {why}; give every class of the "
                           "federation once, comma-separated, the same list at every site, "
                           "e.g. --classes benign,malignant,naevus")
    return names


def assign_indices(names: list[str], known: dict[str, int] | None, extend: bool,
                   map_path: Path | None, classes: list[str] | None
                   ) -> tuple[dict[str, int], list[str]]:
    """The class map for the class folder ``names``: the federation's ``classes`` in
    their natural order, or ``known`` (the federation's map file), extended by the names
    it lacks when ``extend``; never the folders alone. Returns the map and the names
    added to ``known``."""
    if classes is not None and known is not None:
        raise PrepareError(f"--classes and --class-map={str(map_path)!r}, which exists, both "
                           "name the classes; give one (the map already fixes the indices)")
    if classes is None and known is None:
        raise PrepareError(
            "the class map must be the federation's, not made from the folders this site "
            f"happens to hold{map_hint(names, map_path)}: give every class of the "
            "federation with --classes NAME,NAME,... (the same list at every site, with "
            "the classes this site lacks), or the federation's class map with --class-map "
            "FILE (the classes.json another site or fedefc deploy export wrote); this "
            f"site's class folders: {', '.join(natural_order(names))}"
            f"{missing_numbers(names)}")
    source = f"--class-map={str(map_path)!r}"
    if classes is not None:
        known, source = {name: i for i, name in enumerate(natural_order(classes))}, "--classes"
    unknown = natural_order([n for n in names if n not in known])
    if unknown and not extend:
        raise PrepareError(
            f"class folder(s) {', '.join(map(repr, unknown))} are not in the class map "
            f"{source} (classes: {', '.join(known)}); rename each to a class of the map (the "
            "same class must have the same name at every site), or "
            + ("add the class to --classes at every site" if classes is not None else
               "add --extend-class-map to give it the next index (then give the new map to "
               "every site)"))
    extended = dict(known)
    for name in unknown:
        extended[name] = len(extended)
    return extended, unknown


def map_hint(names: list[str], map_path: Path | None) -> str:
    if len(names) == 1:
        return (f" (SOURCE holds one class folder, {names[0]!r}: if the classes are folders "
                "inside it, point SOURCE at that folder)")
    if map_path is not None:
        return f" (--class-map={str(map_path)!r} does not exist yet: --classes writes it there)"
    return ""


def missing_numbers(names: list[str]) -> str:
    """Where every folder name is a number in digits: the numbers below the largest that
    no folder has, and the complete list (a site lacking class 6 of 0..9 would otherwise
    copy its own nine folders and shift 7, 8, 9 down by one)."""
    if not all(n.isdigit() for n in names):
        return ""
    values = sorted({int(n) for n in names})
    gaps = sorted(set(range(values[-1] + 1)) - set(values))
    if not gaps:
        return ""
    full = ",".join(str(v) for v in range(values[-1] + 1))
    return (f"; no folder for {', '.join(map(str, gaps))}: if the federation has "
            f"{'that class' if len(gaps) == 1 else 'those classes'}, name "
            f"{'it' if len(gaps) == 1 else 'them'} too, e.g. --classes {full}")


def check_layout(folders: dict[str, Path], named: Collection[str], source: Path) -> None:
    """Refuse SOURCE/train, SOURCE/test, ...: a layout one level above the classes (a
    folder of a split's name that the federation's classes, ``named``, hold is a class)."""
    splits = sorted(n for n in folders if n.lower() in SPLIT_NAMES and n not in named)
    if splits and len(splits) == len(folders):
        first = folders[splits[0]]
        raise PrepareError(
            f"SOURCE={str(source)!r} holds the split folders {', '.join(splits)}, not class "
            f"folders; prepare each split on its own with one class map, e.g. fedefc data "
            f"{first} OUT/{splits[0]} --size ... --classes ..., then the others with "
            f"--class-map OUT/{splits[0]}/classes.json")


def image_files(folder: Path) -> list[Path]:
    """Every non-hidden file in ``folder`` and the folders beneath it, in the order of
    their paths (compared folder by folder)."""
    found = []
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(top) / f for f in files if not f.startswith(".")]
    return sorted(found, key=lambda f: f.relative_to(folder).parts)


def stretch_to_8bit(img: Image.Image) -> Image.Image:
    """An image of more than 8 bits per sample (modes I, I;16*, F) as 8-bit grayscale:
    its own minimum -> 0, its own maximum -> 255, linear in between (0 if constant)."""
    values = np.asarray(img).astype(np.float64)
    low, high = float(values.min()), float(values.max())
    scaled = (values - low) * (255.0 / (high - low)) if high > low else np.zeros_like(values)
    return Image.fromarray(np.round(scaled).astype(np.uint8))


def to_channels(img: Image.Image, channels: int) -> Image.Image:
    """8-bit grayscale (``channels`` 1) or RGB (3): deep images stretched
    (:func:`stretch_to_8bit`), transparency composited onto black."""
    if img.mode in ("I", "F") or img.mode.startswith("I;"):
        img = stretch_to_8bit(img)
    if "A" in img.mode or "a" in img.mode or "transparency" in img.info:
        rgba = img.convert("RGBA")
        black = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        img = Image.alpha_composite(black, rgba)
    return img.convert("L" if channels == 1 else "RGB")


def resize(img: Image.Image, size: tuple[int, int], fit: str) -> Image.Image:
    """``img`` at ``size`` (height, width) by the ``fit`` rule (module docstring)."""
    h, w = size
    if fit == "crop":
        return ImageOps.fit(img, (w, h), Image.Resampling.BICUBIC)
    if fit == "pad":
        return ImageOps.pad(img, (w, h), Image.Resampling.BICUBIC, color=0)
    return img.resize((w, h), Image.Resampling.BICUBIC)


def decode(path: Path, channels: int, size: tuple[int, int], fit: str
           ) -> tuple[np.ndarray, str, str, tuple[int, int]]:
    """(uint8 pixels (C, H, W), format, mode as stored, (width, height) as displayed) of
    one image file; Pillow's errors propagate."""
    with Image.open(path) as img:
        fmt, mode = img.format or "?", img.mode
        upright = ImageOps.exif_transpose(img)
        shown = upright.size
        pixels = np.asarray(resize(to_channels(upright, channels), size, fit), dtype=np.uint8)
    return pixels.reshape(size[0], size[1], channels).transpose(2, 0, 1), fmt, mode, shown


def skip_reason(err: Exception) -> str:
    if isinstance(err, UnidentifiedImageError):
        return "not an image Pillow can read"
    return f"unreadable ({type(err).__name__}: {err})"


def prepare(source: Path, out: Path, size: tuple[int, int], channels: str = "rgb",
            fit: str = "crop", class_map: Path | None = None, extend: bool = False,
            progress: Callable[[str], None] | None = None, shared: bool = False,
            classes: list[str] | None = None) -> dict:
    """Write OUT/data.npz, OUT/classes.json and OUT/summary.json from the class folders
    of ``source`` with the federation's ``classes`` or ``class_map`` (module docstring),
    owner-only unless ``shared`` (:func:`write_output`); returns the summary."""
    source, out = source.expanduser().resolve(), out.expanduser().resolve()
    if channels not in CHANNELS or fit not in FITS:
        raise PrepareError(f"channels={channels!r}, fit={fit!r}: use channels "
                           f"{'/'.join(CHANNELS)} and fit {'/'.join(FITS)}")
    if extend and class_map is None:
        raise PrepareError("--extend-class-map needs --class-map FILE: the map to extend")
    check_out(out, source)
    folders, loose = class_folders(source)
    map_path = class_map.expanduser().resolve() if class_map else None
    known = read_class_map(map_path) if map_path and map_path.exists() else None
    check_layout(folders, set(known or classes or ()), source)
    mapping, added = assign_indices(list(folders), known, extend, map_path, classes)

    c = CHANNELS[channels]
    files = [(name, f) for name in natural_order(list(folders)) for f in image_files(folders[name])]
    images = np.empty((len(files), c, *size), dtype=np.uint8)  # untouched pages cost nothing
    labels = np.empty(len(files), dtype=np.int64)
    sources = []
    found = Found(skipped=[(f.name, "not inside a class folder") for f in loose])
    n = 0
    for i, (name, path) in enumerate(files, 1):
        try:
            pixels, fmt, mode, (w, h) = decode(path, c, size, fit)
        except DAMAGED as err:  # the file's reason to be skipped, not the run's to stop
            found.skipped.append((str(path.relative_to(source)), skip_reason(err)))
            continue
        images[n], labels[n] = pixels, mapping[name]
        sources.append(path.relative_to(source).as_posix())
        n += 1
        found.counts[name] += 1
        found.formats[fmt] += 1
        found.modes[mode] += 1
        found.sizes[f"{w}x{h}"] += 1
        if progress and i % PROGRESS_EVERY == 0:
            progress(f"fedefc data: {i}/{len(files)} files read")
    check_found(found, folders, source)

    summary = make_summary(source, out, size, c, fit, mapping, added, map_path, known, found, n)
    write_output(out, {"images": images[:n], "labels": labels[:n],
                       "sources": np.array(sources, dtype=str),
                       "class_names": np.array(sorted(mapping, key=mapping.get), dtype=str)},
                 mapping, summary, shared)
    if map_path is not None and (known is None or added):
        map_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(map_path, class_map_bytes(mapping))
    return summary


def check_out(out: Path, source: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise PrepareError(f"OUT={str(out)!r} already exists; choose a new folder (nothing is "
                           "overwritten)")
    if out == source or source in out.parents:
        raise PrepareError(f"OUT={str(out)!r} is inside SOURCE={str(source)!r}, where a later "
                           "preparation would read it as a class; choose a folder outside it")


def check_found(found: Found, folders: dict[str, Path], source: Path) -> None:
    """Refuse a folder with no readable image, or a class folder without one."""
    def listed(skipped):
        shown = "; ".join(f"{f}: {r}" for f, r in skipped[:5])
        return shown + (f"; ... ({len(skipped)} in all)" if len(skipped) > 5 else "")

    if not found.counts:
        raise PrepareError(f"SOURCE={str(source)!r}: no file in its class folders is an image "
                           f"Pillow can read ({listed(found.skipped) or 'they hold no files'}); "
                           "give a folder of PNG, JPEG, BMP, GIF, TIFF or WebP images")
    for name in natural_order(list(folders)):
        if not found.counts[name]:
            mine = [s for s in found.skipped if Path(s[0]).parts[0] == name]
            raise PrepareError(f"class folder {name!r} holds no readable image "
                               f"({listed(mine) or 'it is empty'}); add its images, or remove "
                               "the folder if this site has no such class")


def make_summary(source: Path, out: Path, size: tuple[int, int], c: int, fit: str,
                 mapping: dict[str, int], added: list[str], map_path: Path | None,
                 known: dict[str, int] | None, found: Found, n: int) -> dict:
    shape = shape_text((c, *size))
    data = out / "data.npz"
    return {
        "source": str(source),
        "data": str(data),
        "input_shape": shape,
        "num_classes": len(mapping),
        "fit": fit,
        "channels": c,
        "images": n,
        "classes": [{"name": name, "index": index, "images": found.counts[name]}
                    for name, index in sorted(mapping.items(), key=lambda kv: kv[1])],
        "class_map": str(map_path or out / "classes.json"),
        "class_map_origin": ("new" if known is None else "extended" if added else "given"),
        "classes_added": added,
        "formats": dict(found.formats.most_common()),
        "modes": dict(found.modes.most_common()),
        "sizes": dict(found.sizes.most_common()),
        "skipped": [{"file": f, "reason": r} for f, r in found.skipped],
        "warnings": [w for w in (number_order_warning(mapping),) if w],
        "run_keys": {"dataset": "npz", "data-path": str(data), "num-classes": len(mapping),
                     "input-shape": shape},
    }


def class_map_bytes(mapping: dict[str, int]) -> bytes:
    ordered = dict(sorted(mapping.items(), key=lambda kv: kv[1]))
    return (json.dumps(ordered, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def write_output(out: Path, arrays: dict[str, np.ndarray], mapping: dict[str, int],
                 summary: dict, shared: bool = False) -> None:
    """OUT (``arrays`` as data.npz), written beside it under a hidden name and renamed
    into place when complete:
    owner-only (0700 / 0600, docs/PRIVACY.md §6: the images and labels are the node's
    private data), its missing parents too; with ``shared`` (``--readable-by-others``)
    data.npz and OUT readable by others (0644 / 0755: a container whose SuperExec user
    differs from the writer reads a read-only mount)."""
    make_private_dir(out.parent)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        with open_private(tmp / "data.npz", "wb") as fh:
            np.savez(fh, **arrays)
        (tmp / "data.npz").chmod(0o644 if shared else FILE_MODE)
        atomic_write_bytes(tmp / "classes.json", class_map_bytes(mapping))
        atomic_write_json(tmp / "summary.json", summary)
        tmp.chmod(0o755 if shared else DIR_MODE)
        if out.exists():
            out.rmdir()  # the empty folder check_out allowed
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def describe(summary: dict) -> str:
    """The summary as the lines ``fedefc data`` prints."""
    lines = [f"fedefc data: {summary['images']} images in {summary['num_classes']} classes "
             f"from {summary['source']}", f"  {'index':>5}  {'images':>7}  class"]
    lines += [f"  {c['index']:>5}  {c['images']:>7}  {c['name']}" for c in summary["classes"]]
    absent = [c["name"] for c in summary["classes"] if not c["images"]]
    if absent:
        lines.append(f"  absent at this site (in the class map): {', '.join(absent)}")
    lines += [f"  WARNING: {w}" for w in summary["warnings"]]
    counts = (("formats", summary["formats"]), ("modes as stored", summary["modes"]))
    lines += [f"  {label}: " + ", ".join(f"{k} {v}" for k, v in seen.items())
              for label, seen in counts]
    sizes = summary["sizes"]
    common = ", ".join(f"{k} ({v})" for k, v in list(sizes.items())[:3])
    lines.append(f"  sizes (width x height): {len(sizes)} distinct; most common {common}")
    if summary["skipped"]:
        lines.append(f"  skipped {len(summary['skipped'])} files:")
        lines += [f"    {s['file']}: {s['reason']}" for s in summary["skipped"]]
    lines.append(f"wrote {summary['data']}: {summary['input_shape']} (C x H x W) uint8 images, "
                 f"fit {summary['fit']}")
    origin = {"new": "written from --classes: every other site gives the same --classes, "
                     "or this file with --class-map",
              "given": "given, unchanged",
              "extended": f"extended by {', '.join(summary['classes_added'])}: give the new "
                          "map to every site"}[summary["class_map_origin"]]
    lines.append(f"class map {summary['class_map']} ({origin})")
    keys = summary["run_keys"]
    lines += ["the run: " + " ".join(f"--set {k}={keys[k]}" for k in
                                     ("dataset", "num-classes", "input-shape")),
              f"  in simulation: --set data-path={keys['data-path']}",
              f"  on a SuperNode: fedefc deploy supernode ... --data-path {keys['data-path']}",
              "every site: the same --size, --channels, --fit and class map"]
    return "\n".join(lines)


def write_image_folder(folder: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """uint8 images (N, C, H, W), C = 1 or 3, as ``folder/<label>/<n>.png``: the layout
    :func:`prepare` reads (a folder for each class the node holds; the federation's class
    map names the others)."""
    for c in np.unique(labels):
        (folder / str(int(c))).mkdir(exist_ok=True)
    for n, (x, y) in enumerate(zip(images, labels)):
        pixels = x[0] if x.shape[0] == 1 else x.transpose(1, 2, 0)
        Image.fromarray(np.ascontiguousarray(pixels)).save(folder / str(int(y)) / f"{n}.png")


def cmd_data(args: argparse.Namespace) -> int:
    """``fedefc data SOURCE OUT --size ...``: prints the summary."""
    summary = prepare(Path(args.source), Path(args.out), parse_size(args.size), args.channels,
                      args.fit, Path(args.class_map) if args.class_map else None,
                      args.extend_class_map,
                      progress=lambda line: print(line, file=sys.stderr, flush=True),
                      shared=args.readable_by_others,
                      classes=parse_classes(args.classes) if args.classes else None)
    print(describe(summary))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``data`` command in ``fedefc``'s argparse tree."""
    data = sub.add_parser("data", help="turn a folder of images (one sub-folder per class) "
                                       "into a node's data.npz (docs/OWN-DATA.md)")
    data.add_argument("source", help="folder with one sub-folder of images per class")
    data.add_argument("out", help="a new folder: gets data.npz, classes.json, summary.json")
    data.add_argument("--size", required=True,
                      help="N (N x N pixels) or HxW (height x width), e.g. 64 or 96x128")
    data.add_argument("--channels", choices=list(CHANNELS), default="rgb",
                      help="gray (1 channel) or rgb (3); default %(default)s")
    data.add_argument("--fit", choices=FITS, default="crop",
                      help="crop: cover and cut the centre; pad: fit inside, black borders; "
                           "stretch: ignore the aspect ratio; default %(default)s")
    data.add_argument("--classes", default=None, metavar="NAME,NAME,...",
                      help="every class of the federation, comma-separated, the same list "
                           "at every site (indices: their sorted order, by value when all "
                           "are numbers), e.g. --classes benign,malignant; or --class-map")
    data.add_argument("--class-map", default=None,
                      help="the federation's class map JSON {name: index}: read when it "
                           "exists (the same indices at every site); written there from "
                           "--classes when it does not")
    data.add_argument("--extend-class-map", action="store_true",
                      help="give class folders missing from --class-map the next indices "
                           "and rewrite it")
    data.add_argument("--readable-by-others", action="store_true",
                      help="write data.npz 0644 in a 0755 folder, for a container whose "
                           "user differs from yours; default: owner-only (0600 / 0700)")
    data.set_defaults(func=cmd_data)
