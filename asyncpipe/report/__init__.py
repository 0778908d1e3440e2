"""Loss-gap reports from run dirs or W&B: takeaways, tables (mean ± std over seeds, gaps and % closed with 95%
intervals), time to target, plots.

Never imports torch or deepspeed: a report needs only the results.
"""

from asyncpipe.report.build import Report, build_report
from asyncpipe.report.render import print_report, render_terminal
from asyncpipe.report.wandb_log import log_report_to_wandb, report_run_config
from asyncpipe.report.wandb_source import build_report_from_wandb, frames_from_wandb_runs

__all__ = [
    "Report",
    "build_report",
    "build_report_from_wandb",
    "frames_from_wandb_runs",
    "log_report_to_wandb",
    "print_report",
    "render_terminal",
    "report_run_config",
]
