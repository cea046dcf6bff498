"""What a training run tells its user while it runs: the history entries of ``train_state.json`` (a line per
``log_every`` steps: loss, learning rate, gradient norm, pace; the validation scores), the progress bar whose
total follows the time budget, and the line a resumed run says first."""

from __future__ import annotations

import json
import logging
import math
import time

from elmo.train.config import OptimConfig

log = logging.getLogger("elmo.train.loop")  # the training's logger: its lines read as the loop's


class TrainingReport:
    """The loop's reporting: sums over the current log window, the history entries, the bar (rank 0 only)."""

    def __init__(self, state: dict, t: OptimConfig, last_step: int, main: bool, sampled: bool) -> None:
        self.state, self.t, self.last_step, self.main, self.sampled = state, t, last_step, main, sampled
        self.progress = progress_bar(state["step"], last_step) if main else None
        self.first_step = state["step"]
        self.run_start = time.time()
        self._window_loss, self._window_tokens, self._window_start = 0.0, 0, self.run_start

    def step_done(self, loss_sum: float, tokens: int, lr: float, grad_norm: float) -> None:
        """One step's summed loss and target tokens (all ranks); every ``log_every`` steps a history entry."""
        self._window_loss += loss_sum
        self._window_tokens += tokens
        state = self.state
        if state["step"] % self.t.log_every == 0 or state["step"] == self.last_step:
            now = time.time()
            entry = {
                "step": state["step"],
                "tokens": state["tokens"],
                "loss": round(self._window_loss / max(self._window_tokens, 1), 5),
                "sampled": self.sampled,
                "lr": round(lr, 7),
                "grad_norm": round(grad_norm, 4),
                "tokens_per_s": round(self._window_tokens / max(now - self._window_start, 1e-9), 1),
                "elapsed_s": round(state["elapsed_s"], 1),
            }
            state["history"].append(entry)
            if self.progress is not None:
                self.progress.set_postfix(
                    loss=f"{entry['loss']:.3f}",
                    ppl=f"{math.exp(min(entry['loss'], 30)):.1f}",
                    tok_s=f"{entry['tokens_per_s']:.0f}",
                    refresh=False,
                )
            self._window_loss, self._window_tokens, self._window_start = 0.0, 0, now
        if self.progress is not None:
            run_steps, run_s = state["step"] - self.first_step, time.time() - self.run_start
            set_total(self.progress, expected_last_step(state, self.t, self.last_step, run_steps, run_s))
            self.progress.update(1)

    def validated(self, scores: dict) -> None:
        self.state["history"].append(scores)
        if self.main:
            log.info("step %d valid %s", scores["step"], json.dumps(scores))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def progress_bar(initial: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", mininterval=5, dynamic_ncols=True)


def expected_last_step(state: dict, t: OptimConfig, last_step: int, run_steps: int, run_s: float) -> int:
    """The step this run will end at: ``last_step``, or sooner when the time budget runs out first at the pace of
    the ``run_steps`` steps this process took in ``run_s`` seconds. The bar's total, so that its ETA is the time
    budget's and not the step cap's (default.json: 6,000 steps, but 4,800 s)."""
    if t.max_time_s <= 0 or run_steps <= 0 or run_s <= 0:
        return last_step
    left_s = max(0.0, t.max_time_s - state["elapsed_s"])
    return min(last_step, state["step"] + math.ceil(left_s * run_steps / run_s))


def set_total(progress, total: int) -> None:
    if progress.total != total:
        progress.total = total
        progress.refresh()


def resume_line(out, state: dict, t: OptimConfig) -> str:
    """What a resumed run says first: where it continues and what is left of the step cap and the time budget."""
    line = f"resuming {out} from step {state['step']} of {t.max_steps} ({state['tokens']:,} tokens seen"
    if t.max_time_s > 0:
        left = max(0.0, t.max_time_s - state["elapsed_s"])
        line += f"; {state['elapsed_s']:.0f} s of the {t.max_time_s:.0f} s time budget used, {left:.0f} s left"
    return line + ")"
