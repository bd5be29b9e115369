"""The step's token budget when serving: ``qserve serve`` defaults to ``SERVE_MAX_NUM_BATCHED_TOKENS``
(1,024, measured on the GPU: bench/RESULTS.md), the offline engine keeps 2,048, the flag wins, and
``qserve plan`` plans with the server's default."""

from __future__ import annotations

import argparse

from qserve.cli import build_parser
from qserve.commands.serve import SERVE_MAX_NUM_BATCHED_TOKENS, plan_host, serve_step_tokens


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def test_serve_defaults_to_the_serving_budget_and_the_flag_wins(checkpoints):
    assert SERVE_MAX_NUM_BATCHED_TOKENS == 1024
    default = plan_host(parse("serve", checkpoints["llama"], "--device", "cpu"))
    assert default.config.max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS
    chosen = plan_host(parse("serve", checkpoints["llama"], "--device", "cpu", "--max-num-batched-tokens", "4096"))
    assert chosen.config.max_num_batched_tokens == 4096


def test_a_block_larger_than_the_budget_raises_the_budget_to_one_block(checkpoints):
    plan = plan_host(parse("serve", checkpoints["llama"], "--device", "cpu", "--block-size", "2048"))
    assert plan.config.max_num_batched_tokens == 2048


def test_plan_uses_the_servers_default():
    args = parse("plan", "some/model", "--gpu-memory-budget", "24GiB")
    assert serve_step_tokens(args) == SERVE_MAX_NUM_BATCHED_TOKENS
    args = parse("plan", "some/model", "--gpu-memory-budget", "24GiB", "--block-size", "2048")
    assert serve_step_tokens(args) == 2048  # as the server would, not a budget below one block
