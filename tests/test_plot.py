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
