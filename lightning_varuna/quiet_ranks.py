"""Imported only by the fork server that starts the processes of the profiler's step runs (`step_runs`): in them,
Lightning's start-up lines and warnings (about this machine, the data loading) are left out. The runs are the
profiler's, not the user's; its progress bar shows them."""

import logging
import warnings

import lightning.pytorch  # noqa: F401  (its loggers are set up as it is imported)

warnings.simplefilter("ignore")
for name in ("lightning.pytorch", "lightning.fabric", "lightning_varuna"):
    logging.getLogger(name).setLevel(logging.WARNING)
for name, logger in list(logging.Logger.manager.loggerDict.items()):
    if name.startswith(("lightning.", "lightning_varuna.")) and isinstance(logger, logging.Logger):
        logger.setLevel(logging.WARNING)
