"""The ``kadapt`` command: a click group whose subcommands are imported only when run.

One module per subcommand (``cli/<name>.py`` exposing ``command``). The group imports none of
them for ``--help`` and only the one invoked otherwise, so ``kadapt --help`` and
``kadapt validate`` never import torch or transformers.
"""

from __future__ import annotations

import importlib

import click

from .. import __version__
from ..errors import KadaptError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("kimi_adapter_core.cli.validate", "Validate and lint adapter specs (files or folders)."),
    "schema": ("kimi_adapter_core.cli.schema", "Print the JSON Schema of the spec language."),
    "apply": ("kimi_adapter_core.cli.apply", "Apply a spec, build the model and run a backend."),
    "pin": ("kimi_adapter_core.cli.pin", "Recompute the signature/source pins of a spec's patches."),
    "generate": ("kimi_adapter_core.cli.generate", "Render wrapper modules and docs from a spec."),
    "plan": ("kimi_adapter_core.cli.plan", "Size a deployment: KV cache, weights, activations."),
    "simulate": ("kimi_adapter_core.cli.simulate", "Estimate latency and memory with a roofline model."),
}


class LazyGroup(click.Group):
    """Resolve ``SUBCOMMANDS`` on demand; ``--help`` lists them from their one-line summaries."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = SUBCOMMANDS.get(cmd_name)
        if entry is None:
            return None
        return importlib.import_module(entry[0]).command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):  # noqa: ANN201 - click's signature
        try:
            return super().invoke(ctx)
        except KadaptError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kadapt")
def cli() -> None:
    """kadapt: declarative adapters that make huge Hugging Face models extractable and simulatable.

    A YAML spec (see `kadapt schema`) declares config bridges, environment shims, class patches,
    module paths and the prefill/decode ABI; `kadapt apply SPEC` applies it behind its model_type
    gate and runs the extraction backend.
    """


def main() -> None:
    cli(prog_name="kadapt")
