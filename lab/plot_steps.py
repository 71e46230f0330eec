"""Draw docs/img/h200-6747d01-steps.png: the evidence of ``backend="auto"``'s rule.

A jitted forward + backward step's marginal time (``python -m gpurouter steps
--json``) against the call's logits (tokens x experts), for the jnp reference
and the kernels through the ffi transport, with the rule's threshold
(``gpurouter._auto.AUTO_MIN_ELEMENTS["ffi"]``) as a vertical line.

    python lab/plot_steps.py lab/results/h200-6747d01-steps.json docs/img/h200-6747d01-steps.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

EXPERTS = {"deepseek-v3": 256, "qwen3": 128, "mixtral": 8, "nemotron-3-super": 512}


def main(src: str, dst: str) -> None:
    with open(src) as f:
        saved = json.load(f)
    rows = [r for r in saved["steps"] if not r["aux"] and r["preset"] in EXPERTS]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for j, preset in enumerate(dict.fromkeys(r["preset"] for r in rows)):
        mine = sorted((r for r in rows if r["preset"] == preset), key=lambda r: r["tokens"])
        xs = [r["tokens"] * EXPERTS[preset] for r in mine]
        ax.plot(xs, [r["jax"] for r in mine], "o--", color=f"C{j}", label=f"{preset}: jax")
        ax.plot(xs, [r["numba:ffi"] for r in mine], "s-", color=f"C{j}", label=f"{preset}: numba:ffi")
    ax.axvline(1 << 19, color="grey", lw=1)
    ax.text(1 << 19, ax.get_ylim()[1], ' "auto" picks numba from 2^19 (ffi)', va="top", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("logits per call (tokens x experts)")
    ax.set_ylabel("us per forward + backward step")
    info = saved["info"]
    ax.set_title(f"jitted router steps on {info['gpu']} ({info['date']}, commit {info['commit']})", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
