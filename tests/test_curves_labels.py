"""What curves.png says (issue 60): the A(t) panel names what A(t) and the guard read
(training labels, a held-out share, verified labels, the coordinator's clean set), the
clean set's accuracy is drawn where the server recorded it, and the sites' rows carry
their names where the run knows them (docs/OWN-DATA.md, "Verified labels"; the texts
are read off matplotlib's Figure, not a snapshot of the picture)."""

from fedefc_server.allowlist import Allowlist
from fedefc_server.curves import figure, series
from tests.test_run_report import hand_written_records

BASE = {"method": "fedefc", "dataset": "npz", "seed": 0, "status": "completed"}


def texts(fig) -> tuple[list[str], list[str], list[str]]:
    """(every panel's title, every legend label, the site panel's row labels)."""
    axes = fig.axes
    legends = [t.get_text() for ax in axes if ax.get_legend()
               for t in ax.get_legend().get_texts()]
    return ([ax.get_title() for ax in axes], legends,
            [t.get_text() for t in axes[-1].get_yticklabels()])


def test_verified_labels_and_held_out_shares_are_told_apart():
    verified = {**BASE, "accuracy_signal": "held-out", "validation_labels": "verified",
                "guard_signal": "the verified labels of the twin's guard slices"}
    held = {**verified, "validation_labels": "observed",
            "guard_signal": "the held-out accuracy on the clients' shares, through Q"}
    titles_v, legend_v, _ = texts(figure(series(hand_written_records()), verified, 3))
    titles_h, legend_h, _ = texts(figure(series(hand_written_records()), held, 3))
    assert titles_v[1] == ("A(t) on the clients' verified labels; the guard reads the "
                           "verified labels of the twin's guard slices")
    assert titles_h[1] == ("A(t) on the clients' held-out share (noisy labels); the guard "
                           "reads the held-out accuracy on the clients' shares, through Q")
    assert "A(t) on the clients' verified labels" in legend_v
    assert not any("verified" in label for label in legend_h + titles_h)
    paper = {**BASE, "accuracy_signal": "global", "guard_signal": None}
    assert texts(figure(series(hand_written_records()), paper, 3))[0][1] == (
        "A(t) on the clients' training labels")


def test_the_clean_set_s_accuracy_is_drawn_where_the_server_recorded_it():
    recs = [{**r, "clean_acc": 0.05 * r["round"] + 0.5} for r in hand_written_records()
            if r["round"] > 0]
    fedavg = {**BASE, "method": "fedavg",
              "clean_set": "the coordinator's clean validation set (29 samples, c.npz)"}
    no_a = [{k: v for k, v in r.items() if k != "A"} for r in recs]
    fig = figure(series(no_a), fedavg, 3)
    [line] = [ln for ln in fig.axes[0].get_lines()
              if "clean validation set" in ln.get_label().replace("\n", " ")]
    assert line.get_label().replace("\n", " ") == (
        "accuracy on the coordinator's clean validation set (29 samples, c.npz)")
    assert list(line.get_xdata()) == list(range(1, 7))
    assert list(line.get_ydata()) == [0.05 * t + 0.5 for t in range(1, 7)]
    without = figure(series(hand_written_records()), BASE, 3)
    assert not any("clean" in ln.get_label() for ln in without.axes[0].get_lines())


def test_the_guard_on_the_clean_set_is_named_in_its_panel():
    recs = [{**r, "guard_acc": 0.7} if r["round"] > 0 else r for r in hand_written_records()]
    summary = {**BASE, "accuracy_signal": "held-out", "validation_labels": "observed",
               "guard_signal": "the coordinator's clean validation set (29 samples, c.npz)"}
    titles, legend, _ = texts(figure(series(recs), summary, 3))
    assert titles[1].endswith("the guard reads the coordinator's clean validation set "
                              "(29 samples, c.npz)")
    assert any(label.replace("\n", " ").startswith("guard reads the coordinator's clean")
               for label in legend)


def test_site_rows_carry_the_allowlist_s_names_or_the_partition(tmp_path):
    path = tmp_path / "allow.toml"
    path.write_text("".join(
        f'[[node]]\npublic-key = "SHA256:{"k" * 42}{p}"\npartition-id = {p}\n'
        f'data = "private"\nmax-samples = 10\n' + (f'name = "{name}"\n' if name else "")
        for p, name in ((0, "Oslo"), (1, None), (2, "Bergen"))))
    names = Allowlist.load(str(path), 3).site_names()
    assert names == {"0": "Oslo", "2": "Bergen"}
    rows = texts(figure(series(hand_written_records()), {**BASE, "site_names": names}, 3))[2]
    assert rows == ["Oslo (0)", "partition 1", "Bergen (2)"]
    plain = texts(figure(series(hand_written_records()), BASE, 3))[2]
    assert plain == ["partition 0", "partition 1", "partition 2"]
