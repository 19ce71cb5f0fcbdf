"""The `llmopt` command line. Thin by design: each command parses options and calls one library function."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console

from llmopt import __version__
from llmopt.errors import LlmoptError

app = typer.Typer(
    name="llmopt",
    help="Make LLMs cheaper and faster to run without making them dumber.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        console.print(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """llmopt: memory plans, calibration, quantization, eval gates, serving and benchmarks."""


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.command("vram-plan")
def vram_plan(
    model: Optional[str] = typer.Argument(None, help="Alias (smollm2-135m), HF model dir, config.json or .gguf."),
    weight_dtype: str = typer.Option("auto", help="auto|fp32|fp16|bf16|fp8|int8|int4"),
    group_size: Optional[int] = typer.Option(
        None, help="Group size of int4/int8 scales; -1 per channel. Default: -1 for int8, 128 (or the largest "
        "size that divides the model) for int4."),
    kv_dtype: str = typer.Option("auto", help="auto|fp32|fp16|bf16|fp8|int8"),
    seq_len: int = typer.Option(2048, help="Tokens per sequence (prompt + output)."),
    batch: int = typer.Option(1, help="Concurrent sequences."),
    gpu_memory: str = typer.Option("24GiB", help="Memory per GPU: 24GiB, 24GB, 24G or bytes."),
    num_gpus: int = typer.Option(1, help="GPUs available; adds a tensor/pipeline/data-parallel plan."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The memory bill for weights, KV cache and activations, and how many requests fit."""
    from llmopt.models import resolve_model
    from llmopt.planning.vram import VramPlanOptions, plan_vram, render_vram_plan
    from llmopt.units import parse_bytes

    resolved = resolve_model(model)
    opts = VramPlanOptions(
        weight_dtype=weight_dtype,
        group_size=group_size,
        kv_dtype=kv_dtype,
        seq_len=seq_len,
        batch=batch,
        gpu_memory_bytes=parse_bytes(gpu_memory),
        num_gpus=num_gpus,
    )
    plan = plan_vram(resolved.spec, opts, model_name=resolved.name)
    if as_json:
        _print_json(plan.to_json())
    else:
        render_vram_plan(plan, console)


@app.command()
def generate(
    model: Optional[str] = typer.Argument(None, help="Alias (smollm2-135m), HF model dir or .gguf."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    chat: bool = typer.Option(False, help="Apply the model's chat template (one user turn)."),
    max_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    dtype: str = typer.Option("auto", help="auto|float32|bfloat16|float16"),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
    kv_cache_dtype: str = typer.Option("auto", help="auto|int8"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate one completion through the llmopt engine, streaming it to the terminal."""
    from llmopt import LLM, SamplingParams
    from llmopt.engine.llm import stream_text

    llm = LLM(model, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype, max_num_seqs=1)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
    final = None
    for piece in stream_text(llm, prompt, params, chat=chat):
        if isinstance(piece, str):
            if not as_json:
                console.out(piece, end="", highlight=False)
        else:
            final = piece
    out = final.outputs[0]
    m = final.metrics
    n = len(out.token_ids)
    decode_s = (m.finished_time - m.first_token_time) if n > 1 else 0.0
    summary = {"text": out.text, "finish_reason": out.finish_reason, "prompt_tokens": len(final.prompt_token_ids),
               "output_tokens": n, "ttft_ms": round(m.ttft * 1000, 1),
               "decode_tok_s": round((n - 1) / decode_s, 1) if decode_s > 0 else None,
               "dtype": str(llm.engine.dtype).replace("torch.", ""), "device": str(llm.engine.device)}
    if as_json:
        _print_json(summary)
    else:
        console.out("")
        err_console.print(f"[dim]{n} tokens · finish {out.finish_reason} · TTFT {summary['ttft_ms']} ms · "
                          f"decode {summary['decode_tok_s']} tok/s · {summary['dtype']} on {summary['device']}[/]")


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2 (1 for failed gates)."""
    from pydantic import ValidationError

    try:
        app(standalone_mode=False)
    except LlmoptError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        err_console.print(f"[bold red]error:[/] invalid {loc or 'input'}: {first.get('msg')}", highlight=False,
                          soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
