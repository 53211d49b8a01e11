"""python -m llmc_py.plot: reads main.log, draws loss.png."""
import builtins

from llmc_py import plot

LOG = "s:1 trl:10.5 lr:1e-4 norm:2.0\ns:2 trl:9.25 lr:2e-4 norm:1.5\ns:2 tel:9.75\njunk\n"


def test_read_log(tmp_path):
    (tmp_path / "main.log").write_text(LOG)
    train, val = plot.read_log(tmp_path / "main.log")
    assert train == {1: 10.5, 2: 9.25} and val == {2: 9.75}


def test_plot_writes_a_png(tmp_path, capsys):
    (tmp_path / "main.log").write_text(LOG)
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_errors(tmp_path, capsys, monkeypatch):
    assert plot.main([str(tmp_path)]) == 1                       # no main.log
    assert "main.log" in capsys.readouterr().err
    (tmp_path / "main.log").write_text("nothing\n")
    assert plot.main([str(tmp_path)]) == 1
    assert "no loss lines" in capsys.readouterr().err
    (tmp_path / "main.log").write_text(LOG)
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert plot.main([str(tmp_path)]) == 1
    assert "pip install" in capsys.readouterr().err


def test_plot_draws_the_monitors_of_a_run(shards, tmp_path, capsys):
    from llmc_py import train
    train_glob, val_glob = shards
    out = tmp_path / "out"
    assert train.main(["-i", train_glob, "-j", val_glob, "-o", str(out), "-e", "d2", "-b", "2",
                       "-t", "16", "-x", "4", "-v", "0", "-s", "0", "--monitor-every", "1"]) == 0
    capsys.readouterr()
    assert plot.main([str(out)]) == 0
    assert capsys.readouterr().out.split() == ["wrote", str(out / "loss.png"),
                                               "wrote", str(out / "monitors.png")]
    assert (out / "monitors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (out / "metrics.jsonl").write_text("")          # no measurements: no monitors figure
    (out / "monitors.png").unlink()
    assert plot.main([str(out)]) == 0
    assert not (out / "monitors.png").exists()


def monitored_run(shards, out, steps):
    """A tiny real run with metrics at every step: (its records, its train loss)."""
    from llmc_py import train
    from llmc_py.monitors import read_metrics
    train_glob, val_glob = shards
    assert train.main(["-i", train_glob, "-j", val_glob, "-o", str(out), "-e", "d2", "-b", "2",
                       "-t", "16", "-x", str(steps), "-v", "0", "-s", "0",
                       "--monitor-every", "1"]) == 0
    return read_metrics(out / plot.METRICS_FILE), plot.read_curves(out)[0]


def assert_whole_step_ticks(fig):
    fig.canvas.draw()
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(t == int(t) for t in ticks), (ax.get_title(), ticks)


def test_monitors_figure_keeps_one_colour_per_layer(shards, tmp_path, capsys):
    import matplotlib.colors
    records, train_loss = monitored_run(shards, tmp_path / "out", 2)   # 2 layers, 2 steps
    fig = plot.plot_monitors(plot.pyplot("test"), records, train_loss, "monitors: out")
    colours = {}                           # a line's series ("layer 0", "embedding") -> colours
    panels = fig.axes[1:8]                 # every panel but the loss
    for ax in fig.axes[:8]:
        for line in ax.get_lines():
            assert not line.get_label().startswith("_"), ax.get_title()   # every line labelled
            series = line.get_label().split(",")[0]
            colours.setdefault(series, set()).add(matplotlib.colors.to_hex(line.get_color()))
    assert all(ax.get_lines() for ax in panels)
    assert {"layer 0", "layer 1", "embedding"} <= set(colours)
    assert all(len(c) == 1 for c in colours.values()), colours        # the same in every panel
    layers = [colours["layer 0"].pop(), colours["layer 1"].pop()]
    assert len(set(layers)) == 2 and colours["embedding"].pop() not in layers
    for ax in panels:                      # layer lines in every panel; their legend is shared
        assert {"layer 0", "layer 1"} <= {line.get_label() for line in ax.get_lines()}
        assert ax.get_legend() is None and fig.axes[0].get_legend() is None
    legend, = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "layer 0", "layer 1", "embedding", "min over heads", "train loss", "probe batch loss"]
    assert_whole_step_ticks(fig)           # two steps: 1 and 2, never 1.5


def test_loss_figure_title_and_ticks():
    fig = plot.plot_loss(plot.pyplot("test"), {1: 10.5, 2: 9.25}, {2: 9.75}, "runs/d2")
    assert fig.axes[0].get_title() == "train and val loss: runs/d2"
    assert_whole_step_ticks(fig)


def test_layer_colours_are_distinct_and_never_the_non_layer_ones():
    import matplotlib.colors
    for L in (1, 9, 12, 48):
        colours = [matplotlib.colors.to_hex(c) for c in plot.layer_colors(L)]
        assert len(set(colours)) == L
        assert not {"#000000", "#808080", "#7f7f7f"} & set(colours)   # black, grey: non-layers
