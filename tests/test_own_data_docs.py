"""docs/OWN-DATA.md as a reader follows it: the summary "Preparing a folder of images"
shows is what ``fedefc data`` prints for the folder the tests write; the model module of
"Shipping your model to every node", saved as the page lays it out, passes the check
command the page gives, which prints what the page says it prints."""

import contextlib
import io
import re
from pathlib import Path

from fedefc_cli.main import main
from tests.test_prepare_data import write_site

DOC = Path(__file__).resolve().parents[1] / "docs" / "OWN-DATA.md"


def section(text: str, title: str) -> str:
    start = re.search(f"^#+ {re.escape(title)}\n", text, re.M).start()
    return text[start:text.index("\n## ", start + 1)]


def test_the_documented_summary_is_what_fedefc_data_prints(tmp_path, capsys):
    text = section(DOC.read_text(), "Preparing a folder of images")
    shown = re.search(r"```\n(fedefc data: .*?)```", text, re.S).group(1).splitlines()
    site = write_site(tmp_path / "site-a" / "images")
    command = re.search(r"```bash\n(fedefc data /data/images .*?)\n```", text, re.S).group(1)
    classes = re.search(r"--classes (\S+)", command).group(1)
    assert main(["data", str(site), str(tmp_path / "site-a" / "prepared"), "--size", "64",
                 "--classes", classes]) == 0
    printed = capsys.readouterr().out.replace(str(tmp_path), "/tmp/dd").splitlines()
    assert len(printed) == len(shown)
    for got, doc in zip(printed, shown):
        if "broken.jpg: unreadable (" in doc:  # Pillow's own words may change
            doc, got = doc.split("(")[0], got.split("(")[0]
        assert got == doc


def test_the_documented_model_package_passes_the_documented_check(tmp_path, monkeypatch):
    text = section(DOC.read_text(), "Shipping your model to every node")
    module = re.search(r"```python\n(# mymodels/nets\.py.*?)```", text, re.S).group(1)
    package = tmp_path / "mymodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(module)
    check = re.search(r'\.venv/bin/python -c "(.*?)"\n', text, re.S).group(1)
    promised = re.search(r"which prints `(.*?)`", text, re.S).group(1)
    monkeypatch.syspath_prepend(str(tmp_path))  # as the installed wheel would be
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(check, {})
    assert printed.getvalue().strip() == promised
    assert promised.endswith("feature_dim=64)")  # RoFL can use it
