"""The `rhymerl` command: one sub-command per process (`make run`'s driver is devtools/local_run.py).

Each sub-command's options are its settings class (services/common/settings_cli.py):
`rhymerl worker --help` lists every setting with its environment variable and default.
"""

from __future__ import annotations

import asyncio
import logging

import typer
from pydantic_settings import BaseSettings

from services.common.errors import BindError, SettingError
from services.common.grpc_server import service_up
from services.common.settings_cli import env_var, settings_command
from services.history.settings import HistorySettings
from services.rollout.settings import WorkerSettings
from services.router.settings import RouterSettings
from services.scheduler.settings import SchedulerSettings

log = logging.getLogger("rhymerl")


def serve_or_say_why(name: str, serve, settings_cls: type[BaseSettings] | None = None) -> None:
    """Runs the service's ``serve`` coroutine. What stops it before it serves (a port in
    use, a model that does not load, a store it cannot reach) is said in one line and
    exit status 1, the traceback at --log-level debug; a failure once it served keeps its
    traceback (the log's business). A port it could not bind, or a setting it cannot start
    with (``SettingError``), is named with the option and environment variable (of
    ``settings_cls``) that set it."""
    try:
        asyncio.run(serve)
    except Exception as exc:  # noqa: BLE001 - any failure before serving
        if service_up():
            raise
        log.debug("%s could not start", name, exc_info=True)
        if isinstance(exc, BindError) and settings_cls is not None and exc.setting in settings_cls.model_fields:
            option = "--" + exc.setting.replace("_", "-")
            off = "" if exc.setting == "port" else ", or 0 for none"
            raise SystemExit(f"Error: rhymerl {name} could not start: {exc}; set {option} "
                             f"({env_var(settings_cls, exc.setting)}) to a free port{off}") from None
        if isinstance(exc, SettingError) and settings_cls is not None and exc.setting in settings_cls.model_fields:
            option = "--" + exc.setting.replace("_", "-")
            raise SystemExit(f"Error: rhymerl {name} could not start: {exc}; check {option} "
                             f"({env_var(settings_cls, exc.setting)})") from None
        raise SystemExit(f"Error: rhymerl {name} could not start: {type(exc).__name__}: {exc} "
                         "(--log-level debug shows where)") from None


app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="rhymerl rollout service: each sub-command is one process; --help lists its settings.")


@settings_command(app, "history", HistorySettings, "Run the history service (earlier rollouts per prompt, in Redis).")
def history(settings: HistorySettings) -> None:
    from services.history.server import serve

    serve_or_say_why("history", serve(settings), HistorySettings)


@settings_command(app, "scheduler", SchedulerSettings, "Run the scheduler (trainers submit steps to it).")
def scheduler(settings: SchedulerSettings) -> None:
    from services.scheduler.server import serve

    serve_or_say_why("scheduler", serve(settings), SchedulerSettings)


@settings_command(app, "router", RouterSettings,
                  "Run the step router (trainers submit steps to it; it splits them over scheduler shards).")
def router(settings: RouterSettings) -> None:
    from services.router.server import serve

    serve_or_say_why("router", serve(settings), RouterSettings)


@settings_command(app, "worker", WorkerSettings, "Run a rollout worker (loads the policy, serves WorkerService).")
def worker(settings: WorkerSettings) -> None:
    log.info("loading %s on device %s (torch, model weights, KV cache)...", settings.model_path or "(no model)",
             settings.device)
    from services.rollout.drafter.compiled import DrafterLibraryError
    from services.rollout.engine_choice import check_drafter
    from services.rollout.server import serve

    try:
        check_drafter(settings)  # before the model loads: one line, no traceback
        serve_or_say_why("worker", serve(settings), WorkerSettings)
    except DrafterLibraryError as exc:
        raise SystemExit(f"rhymerl worker: {exc}") from None


if __name__ == "__main__":
    app()
