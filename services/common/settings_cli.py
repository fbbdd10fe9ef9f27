"""Sub-commands whose options are a pydantic-settings class: one option per field.

`rhymerl worker --help` then lists every setting with its environment variable, its
default and its choices (a ``Literal`` field), read from the class itself, so the help
cannot drift from what the service reads. An option given on the command line wins over
the environment variable; an option not given leaves the field to the environment or
the default (pydantic-settings' own order).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Annotated, Literal, Optional

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings

LOG_LEVELS = ("debug", "info", "warning", "error")


def env_var(settings_cls: type[BaseSettings], field: str) -> str:
    return settings_cls.model_config.get("env_prefix", "") + field.upper()


def _option(settings_cls: type[BaseSettings], name: str, field) -> inspect.Parameter:
    flag = "--" + name.replace("_", "-")
    decls = [f"{flag}/--no-{flag[2:]}"] if field.annotation is bool else [flag]
    default = field.default
    shown = ("on" if default else "off") if isinstance(default, bool) else ('""' if default == "" else str(default))
    option = typer.Option(*decls, help=f"{field.description or ''} [env: {env_var(settings_cls, name)}]",
                          show_default=shown)
    # typer turns a Literal into a click.Choice: --help lists the choices, a typo is refused.
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[field.annotation], option])


def settings_command(app: typer.Typer, name: str, settings_cls: type[BaseSettings], help: str,
                     log_level: str = "info") -> Callable:
    """Decorator: registers ``run(settings)`` as sub-command ``name`` of ``app``."""

    def register(run: Callable[[BaseSettings], None]) -> Callable:
        def command(**given) -> None:
            level = given.pop("log_level")
            logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            try:
                settings = settings_cls(**{k: v for k, v in given.items() if v is not None})
            except ValidationError as err:  # a bad option or environment variable: say which, no traceback
                for e in err.errors():
                    if not e["loc"]:  # a rule across settings: its message names them
                        typer.echo(f"Error: {e['msg'].removeprefix('Value error, ')}", err=True)
                        continue
                    field = str(e["loc"][0])
                    typer.echo(f"Error: --{field.replace('_', '-')} ({env_var(settings_cls, field)}): {e['msg']}",
                               err=True)
                raise typer.Exit(2) from None
            run(settings)

        level_var = env_var(settings_cls, "log_level")
        level_option = typer.Option("--log-level", envvar=level_var, help=f"Logging threshold. [env: {level_var}]")
        own = settings_cls.__annotations__  # the class's own fields first, inherited ones (TLS) after
        fields = sorted(settings_cls.model_fields.items(), key=lambda item: item[0] not in own)
        params = [_option(settings_cls, n, f) for n, f in fields]
        params.append(inspect.Parameter("log_level", inspect.Parameter.KEYWORD_ONLY, default=log_level,
                                        annotation=Annotated[Literal[LOG_LEVELS], level_option]))
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}  # typer reads both
        command.__doc__ = help
        app.command(name, short_help=help)(command)  # the whole line in `rhymerl --help`, never cut
        return run

    return register
