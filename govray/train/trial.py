"""The trial: what a user writes. govray supplies data, DDP, governance and checkpoints.

govray owns the step: a trial gives per-example losses, and govray does backward, the governed
allreduce, per-route-group clipping and the optimizer step. So a trial says only how to build the
model, how to turn shard rows into a batch, the per-example loss, and (optionally) the model's
ordered layers, per-example evaluation values and, for packed text, how to tokenize rows. It
contains no DDP, no Ray Data and no governance code; the same class runs in-process (one worker)
and on N Ray Train workers.

The optimizer, the batch size and gradient clipping are not the trial's: they are the experiment's
``training`` section (:mod:`govray.config.training`), overridden per trial by hyperparameters of the
same names (``optimizer``, ``lr``, ``weight_decay``, ``momentum``, ``batch_size``,
``max_grad_norm``, ...). The trial receives them resolved as ``self.settings``; the default
``build_optimizer`` builds ``settings.optimizer``, and a trial may still override it (it must
then build the same optimizer every time: a restore rebuilds it to take its settings).

The memorization probe and the ledger call a few optional hooks (:class:`ProbeHooks`:
``tokens``, ``sequence_scores``, ``representation``); a trial overrides those its measures need.

Example::

    class DigitsTrial(Trial):
        def build_model(self) -> nn.Module:
            return DigitsMLP(hidden=self.hparams["hidden"])

        def layers(self, model: nn.Module) -> list[str]:
            return ["embed", "hidden", "head"]      # optional: default = top-level children

        def collate(self, rows: pa.Table) -> dict[str, torch.Tensor]:
            return {"x": torch.tensor(...), "y": torch.tensor(...)}

        def loss(self, model, batch) -> torch.Tensor:          # shape [batch]: one loss per example
            return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
"""

from __future__ import annotations

import importlib
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from torch import nn
from torch.optim.optimizer import ParamsT

from govray.config.training import OptimizerName, TrainingSettings
from govray.core.errors import ConfigError
from govray.governance.detectors import TokenStats
from govray.governance.policy import DepthPolicy
from govray.governance.routing import RoutingTable, resolve_routes
from govray.train.decoder import decoder_layers, is_transformers_model

Batch = dict[str, torch.Tensor]
# (logits, targets, mask), or the tokens' statistics computed without holding the logits whole.
Predictions = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | TokenStats


class ProbeHooks:
    """Optional hooks that govray calls to measure a run, never to train it.

    Each has a default; a trial overrides the ones its measures need:

    - ``tokens(rows)``: once per worker at the start of a run (and when an attestation's ledger
      is recomputed), over each route's training rows, for the ledger's token counts.
    - ``sequence_scores(model, texts)``: at every validation, for canary exposure — required when
      a corpus declares canaries (``data.corpora[].canaries``; the driver refuses to start
      otherwise, see :func:`defines_sequence_scores`).
    - ``representation(layer, output)``: at every validation, from a forward hook on each
      layer, for the entropy profile of the memorization probe.
    - ``predictions(model, batch)``: at every validation, for the logit detectors of the
      memorization probe (Min-K%, Min-K%++, zlib ratio, confidence: ``governance.detectors``).
    """

    def tokens(self, rows: pa.Table) -> list[int] | None:
        """Tokens per row for the ledger (text trials); None: not a text trial."""
        return None

    def sequence_scores(self, model: nn.Module, texts: Sequence[str]) -> torch.Tensor:
        """Per-text score, lower = more likely (e.g. total NLL in nats), for canary exposure.

        Called without gradients, in eval mode, with the canary corpus's adapter active.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not define sequence_scores(model, texts), which canary "
            "exposure needs"
        )

    def predictions(self, model: nn.Module, batch: Batch) -> Predictions | None:
        """The logits of ``batch``'s examples, their targets and which targets count: a sequence
        model's ``[batch, length, vocabulary]``, ``[batch, length]`` and a bool mask of the same
        shape (False at padding); a classifier's ``[batch, classes]``, ``[batch]`` and None. A
        model whose logits are too large to hold for a whole batch (a large vocabulary) returns
        their ``governance.detectors.TokenStats`` instead, computed a chunk of positions at a time.

        Called without gradients, in eval mode, under the run's autocast. Default None: the
        trial gives no logits, and the probe measures the loss detectors only.
        """
        return None

    def representation(self, layer: str, output: Any) -> torch.Tensor:
        """One row per example of ``layer``'s output, for the entropy profile.

        Default: the first tensor of the output, averaged over every dimension between the batch
        and the feature dimension (a sequence model's positions).
        """
        tensor = output[0] if isinstance(output, tuple | list) else output
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"layer '{layer}' returned {type(output).__name__}; override representation()")
        return tensor.mean(dim=tuple(range(1, tensor.dim() - 1))) if tensor.dim() > 2 else tensor


class Trial(ProbeHooks, ABC):
    """Base class of user trials.

    ``hparams`` are one sample of the experiment's hyperparameter space; ``settings`` are the
    experiment's ``training`` section with those hyperparameters applied (the driver resolves them;
    given none, the defaults with ``hparams`` applied, which is what a trial built by hand for a
    quick test wants).
    """

    def __init__(self, hparams: Mapping[str, Any], settings: TrainingSettings | None = None) -> None:
        self.hparams = dict(hparams)
        self.settings = settings if settings is not None else TrainingSettings().with_hyperparameters(hparams)

    # --- required ---------------------------------------------------------------------------

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model; govray seeds torch's generator before calling it."""

    @abstractmethod
    def collate(self, rows: pa.Table) -> Batch:
        """Tensors for a batch of shard rows (at least one: govray never hands a trial an empty
        batch; a slot without rows runs a stand-in row whose losses it drops)."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Per-example losses, shape ``[len(batch)]``; govray sums them (per-example weighting).

        Under ``data.packing`` a training batch holds windows of tokens (``collate`` gets columns
        ``input_ids``, each ``seq_len`` ids padded with ``pad_id``, and ``tokens``, the real ones):
        return each window's SUM of per-token losses; govray divides by the route group's tokens
        (per-token normalisation). Evaluation and the probe still read rows."""

    # --- optional ---------------------------------------------------------------------------

    pad_id: int = 0  # the id that pads a packed window (``data.packing``) to ``seq_len``

    def layers(self, model: nn.Module) -> Sequence[str] | None:
        """The model's ordered layers (module names) for depth ranges. Default: for a transformers
        decoder, embeddings, each block, final norm, head (:func:`govray.train.decoder.decoder_layers`);
        otherwise None, the model's top-level children."""
        return decoder_layers(model) if is_transformers_model(model) else None

    def fsdp_units(self, model: nn.Module) -> Sequence[str] | None:
        """Under ``resources.strategy: fsdp``, the modules sharded as units (each all-gathered
        before its forward, its gradients reduce-scattered after its backward). Default: the
        layers (:meth:`layers`); a module whose tensors another unit shares stays in the root."""
        return self.layers(model)

    def checkpoint_units(self, model: nn.Module) -> Sequence[str]:
        """Under ``training.activation_checkpointing``, the modules that keep only their inputs in
        the forward and recompute their activations in the backward (non-reentrant, same RNG:
        :func:`govray.train.step.memory_savers.checkpoint_activations`). Default: the layers
        (:meth:`layers`), or the model's top-level children; a transformers decoder: its blocks."""
        layers = self.layers(model)
        return list(layers) if layers is not None else [name for name, _ in model.named_children()]

    def build_meta_model(self) -> nn.Module:
        """The model's structure without its memory: every parameter on the ``meta`` device.

        Routing is resolved on it (:func:`resolve_trial_routes`), so the driver, attestation and
        row lookup never build a full model. Default: :meth:`build_model` under
        ``torch.device("meta")``. A trial whose ``build_model`` loads weights (transformers'
        ``from_pretrained`` refuses the meta device) overrides it to build the same architecture
        from its config: ``with torch.device("meta"): return AutoModelForCausalLM.from_config(config)``.
        """
        with torch.device("meta"):
            return self.build_model()

    def tokenize(self, rows: pa.Table) -> list[list[int]]:
        """The token ids of each shard row, in order, for ``data.packing`` (text packed into
        fixed-length windows, :mod:`govray.data.packing`); ids are integers in ``[0, 2**32)``.

        Packing concatenates rows as given: a trial whose model should see where one row ends
        and the next begins appends its end-of-text id here. Required when the experiment sets
        ``data.packing`` (see :func:`defines_tokenize`).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not define tokenize(rows), which data.packing needs"
        )

    def input_directories(self) -> Mapping[str, Path]:
        """Local directories the trial reads besides its rows (a tokenizer's files), by the
        hyperparameter that names each. The driver records a digest of each one's files with the
        run (``RunSpec.input_digests``), and a replay or a resume refuses to run on files that
        changed since. Default: none."""
        return {}

    def evaluate(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-example evaluation values; govray averages each over the evaluation rows.

        Default: ``{"loss": self.loss(model, batch)}`` (reported as ``validation_loss``).
        """
        return {"loss": self.loss(model, batch)}

    def build_optimizer(self, parameters: ParamsT) -> torch.optim.Optimizer:
        """The optimizer over every trainable tensor (base and adapters), built again with the
        same settings after a restore. Default: ``settings.optimizer``, with torch's defaults for
        what it leaves out. ``parameters`` is what torch's optimizers take: the tensors, or under
        FSDP parameter groups (sharded tensors, then the adapters' whole tensors)."""
        optimizer = self.settings.optimizer
        return _OPTIMIZERS[optimizer.name](parameters, **optimizer.arguments())

    # --- from the settings (govray reads them; a trial need not override them) --------------

    @property
    def batch_size(self) -> int:
        """Rows per worker per step (one schedule slot)."""
        return self.settings.batch_size

    @property
    def max_grad_norm(self) -> float | None:
        """Clip each route group's gradient norm to this (None: no clipping)."""
        return self.settings.max_grad_norm


_OPTIMIZERS: dict[OptimizerName, type[torch.optim.Optimizer]] = {
    OptimizerName.ADAMW: torch.optim.AdamW,
    OptimizerName.ADAM: torch.optim.Adam,
    OptimizerName.SGD: torch.optim.SGD,
}


@contextmanager
def scoring(model: nn.Module) -> Iterator[torch.device]:
    """For ``sequence_scores`` and other measures: the block runs in eval mode without gradients,
    and the model's mode is restored after; yields the device of the model's parameters, where
    the trial puts its batch (the worker's GPU, or the CPU)::

        with scoring(model) as device:
            return nll(model, encode(texts).to(device)).sum(dim=1)
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters(), torch.zeros(())).device
    finally:
        model.train(was_training)


def defines_sequence_scores(trial: type[Trial]) -> bool:
    """Whether a trial class can score texts (what a corpus with canaries needs)."""
    return trial.sequence_scores is not ProbeHooks.sequence_scores


def defines_tokenize(trial: type[Trial]) -> bool:
    """Whether a trial class can tokenize shard rows (what ``data.packing`` needs)."""
    return trial.tokenize is not Trial.tokenize


def make_trial(path: str, hparams: Mapping[str, Any], settings: TrainingSettings | None = None) -> Trial:
    """An instance of the trial class at ``path`` (see :func:`load_trial_class`) for one sample
    of hyperparameters and its resolved settings (None: resolved from ``hparams`` alone, as a run
    recorded before settings were resolved by the driver had them)."""
    return load_trial_class(path)(hparams, settings)


def resolve_trial_routes(policy: DepthPolicy, trial: Trial) -> RoutingTable:
    """``policy`` resolved against ``trial``'s model built on the meta device (no parameter memory;
    the seed is irrelevant: routing reads names, shapes and layers, never values)."""
    name = type(trial).__name__
    try:
        model = trial.build_meta_model()
    except Exception as error:  # a trial's own code: say where routing needs it to work
        raise ConfigError(
            f"trial {name} cannot build its model on the meta device, where routing is resolved: "
            f"{error} (override build_meta_model to build the architecture without weights)"
        ) from error
    placed = sorted({parameter.device.type for parameter in model.parameters()} - {"meta"})
    if placed:
        raise ConfigError(
            f"trial {name} put parameters on {', '.join(placed)} under torch.device('meta'): "
            "build_model must not choose a device (govray places the model), or override "
            "build_meta_model"
        )
    return resolve_routes(policy, model, trial.layers(model))


def importable(directory: str | os.PathLike[str]) -> None:
    """Put ``directory`` first on ``sys.path`` unless it is there already (or is no directory):
    where a trial's module is imported from, like ``python -m`` does with the working directory."""
    path = os.fspath(directory)
    if path and os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)


def load_trial_class(path: str) -> type[Trial]:
    """Import ``"package.module:Class"`` and check it is a :class:`Trial`.

    Like ``python -m``, the working directory is importable: it is the trial's code directory
    (the project root locally, the job's ``working_dir`` under ``ray job submit``).
    """
    importable(os.getcwd())
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"trial '{path}': cannot import module '{module_name}': {error}") from None
    trial = getattr(module, class_name, None)
    if not (isinstance(trial, type) and issubclass(trial, Trial)):
        raise ConfigError(f"trial '{path}': '{class_name}' is not a govray Trial subclass in {module_name}")
    return trial
