"""What a run says as it goes: a live line per step on a terminal, plain
parseable lines otherwise."""
import signal
import sys

from .loop import perplexity


class Progress:
    """A live line per step on a terminal; plain parseable lines otherwise."""

    def __init__(self, stream=None):
        self.stream = sys.stdout if stream is None else stream
        self.live = self.stream.isatty()
        self.open_line = False

    def step(self, step, total, loss, norm, lr, ms, tokens_per_s, eta_s, parts=None):
        """``parts`` (a model with experts): the loss's cross-entropy "ce" and
        auxiliary losses "balance" and "z", said apart; ppl is the ce's."""
        ce = loss if not parts else parts["ce"]
        if self.live:
            apart = "" if not parts else (f"ce {ce:.4f} balance {parts['balance']:.3f} "
                                          f"z {parts['z']:.3f} | ")
            self.stream.write(f"\rstep {step:5d}/{total} | loss {loss:.4f} | {apart}"
                              f"ppl {perplexity(ce):.2f} | norm {norm:.3f} | "
                              f"lr {lr:.2e} | {ms:6.0f} ms | {tokens_per_s:7.0f} tok/s | "
                              f"eta {hours_minutes_seconds(eta_s)}  ")
            self.open_line = True
        else:
            apart = "" if not parts else (f"ce {ce:.6f} balance {parts['balance']:.6f} "
                                          f"z {parts['z']:.6f} ")
            self.stream.write(f"step {step}/{total}: train loss {loss:.6f} {apart}"
                              f"ppl {perplexity(ce):.4f} norm {norm:.4f} "
                              f"lr {lr:.3e} (took {ms:.1f} ms, {tokens_per_s:.0f} tok/s, "
                              f"eta {hours_minutes_seconds(eta_s)})\n")
        self.stream.flush()

    def say(self, text):
        if self.open_line:
            self.stream.write("\n")
            self.open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def warn(self, what, step, e):
        """A failure that costs the run nothing but ``what``."""
        self.say(f"step {step}: warning: {what} failed ({type(e).__name__}: {e}); "
                 f"training goes on")


def format_seconds(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def hours_minutes_seconds(seconds):
    """h:mm:ss, as "0:20:57"."""
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def signal_name(signum):
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
