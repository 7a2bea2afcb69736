"""
lm-evaluation-harness (EleutherAI's lm-eval 0.4, the harness the study scores with) on this
project's checkpoints: `DepthBenchLM`, an lm_eval model registered as 'depthbench', with the
harness's three request types: loglikelihood (multiple choice: ARC, HellaSwag, MMLU, ...),
loglikelihood_rolling (perplexity) and generate_until (greedy or sampled, on the KV cache).

    python -m probes.harness --model depthbench --model_args ckpt=out/cpu_attnres/ckpt.pt \\
        --tasks depthbench_arc_easy --include_path data/evals/harness --batch_size 8

is lm_eval's own command line (`python -m lm_eval`, the same arguments and tables) with
'depthbench' registered: lm-eval 0.4 finds a model only among the modules it has imported
(it has no plugin entry point for models), so `python -m lm_eval --model depthbench` alone
cannot see this one. model_args: ckpt (a checkpoint file or run directory), and optionally
dtype (float32 | bfloat16 | float16), tokenizer, fast ('auto' | True | False), kv_cache (True |
False), max_gen_toks (256), allow_unsealed (False: a checkpoint without a seal is refused); the device is the harness's --device (cuda:0 unless told; the CPU
where there is no CUDA). From Python:

    import lm_eval
    from probes.harness import DepthBenchLM, TASKS_DIR
    lm = DepthBenchLM(ckpt='out/cpu_attnres/ckpt.pt')  # or DepthBenchLM(model=model, tokenizer='gpt2')
    tm = lm_eval.tasks.TaskManager(include_path=str(TASKS_DIR))
    out = lm_eval.simple_evaluate(model=lm, tasks=['depthbench_arc_easy'], task_manager=tm)

The shipped task files (data/evals/harness, offline): depthbench_arc_easy (100 ARC-Easy test
questions, the harness's arc_easy.yaml), depthbench_gsm8k (10 GSM8K test questions,
generate_until, zero-shot), depthbench_webtext (8 documents of the shipped FineWeb-Edu
sample, loglikelihood_rolling). Any harness task runs the same way where its data can be had.

Scoring is one function, `continuation_logprobs` (log p of a continuation given a context,
batched, left-truncated to the model's block_size as lm-eval's HFLM does), used by the adapter
and by the project's own scorers (probes/evals.py: ARC-Easy for the pruning scan, domain NLL),
whose pairs are encoded as the harness encodes them (`encode_pair`).
"""

import functools
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from datasets import Dataset, DatasetDict
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.api.task import ConfigurableTask
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

TASKS_DIR = Path(__file__).resolve().parents[1] / 'data' / 'evals' / 'harness'  # the shipped task files

# -----------------------------------------------------------------------------
# scoring: log p(continuation | context), the model side of the harness's loglikelihood


class Score(NamedTuple):
    logprob: float  # sum of log p over the scored continuation tokens, nats (<= 0)
    n_tokens: int   # how many continuation tokens were scored
    greedy: bool    # every scored token was the argmax (lm-eval's is_greedy)


def _default_device(logits_fn):
    # an nn.Module knows where its weights are; any other callable is assumed to run on the CPU
    params = getattr(logits_fn, 'parameters', None)
    if callable(params):
        p = next(iter(params()), None)
        if p is not None:
            return p.device
    return torch.device('cpu')


@torch.no_grad()
def continuation_logprobs(logits_fn, enc, pairs, *, batch_size=8, max_len=2048, device=None, pad_id=None,
                          progress=False, desc='scoring'):
    """log p(continuation | context) of each pair (docs/probes.md, evaluations), as lm-eval's
    HFLM scores a loglikelihood request.

    logits_fn(idx (B, T) int64) -> logits (B, T, V) at every position: a model, a model with a
    block skipped, a pruned one, ... pairs: (context, continuation) strings, encoded with
    `encode_pair`, or (ctx_ids, cont_ids) token lists. Each sequence ctx + cont keeps its last
    max_len + 1 tokens (left truncation, as lm-eval), the model reads the first max_len of them,
    and the last len(cont) positions are scored, so truncation only ever drops context; a
    continuation longer than max_len tokens has only its last max_len tokens scored. Sequences
    are sorted by length (longest first, so memory problems show at once), right-padded with
    pad_id (default enc.eot; padding sits after every scored position, so a causal model never
    sees it) and run batch_size at a time; log-softmax in fp32. device: where idx is sent;
    default: the device of logits_fn's parameters if it is an nn.Module, else the CPU.
    Returns a list of Score(logprob (nats), n_tokens, greedy) in the input order. Raises
    ValueError on an empty context or continuation, or on a logits shape mismatch."""
    assert max_len >= 1 and batch_size >= 1
    device = _default_device(logits_fn) if device is None else torch.device(device)
    pad_id = enc.eot if pad_id is None else pad_id
    inputs, targets = [], []
    for ctx, cont in pairs:
        if isinstance(ctx, str):
            ctx, cont = encode_pair(enc, ctx, cont)
        if not ctx or not cont:
            raise ValueError("every pair needs a non-empty context and continuation; use encode_pair to build them")
        window = (list(ctx) + list(cont))[-(max_len + 1):]  # left truncation
        n = min(len(cont), len(window) - 1)
        inputs.append(window[:-1])
        targets.append(window[-n:])
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    results = [None] * len(inputs)
    starts = range(0, len(order), batch_size)
    if progress:
        starts = tqdm(starts, desc=desc, unit='batch', disable=None)  # desc: what is scored; no bar in a log file
    for s in starts:
        batch = order[s:s + batch_size]
        T = len(inputs[batch[0]])  # longest in the batch, as sorted
        idx = torch.full((len(batch), T), pad_id, dtype=torch.long)  # (B, T)
        for r, i in enumerate(batch):
            idx[r, :len(inputs[i])] = torch.tensor(inputs[i])
        logits = logits_fn(idx.to(device))  # (B, T, V)
        if logits.dim() != 3 or logits.shape[:2] != idx.shape:
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for input {tuple(idx.shape)}; "
                             "it must return logits at every position, (B, T, V)")
        sums, greedy = [], []
        for r, i in enumerate(batch):
            t_in, n = len(inputs[i]), len(targets[i])
            logp = logits[r, t_in - n:t_in].float().log_softmax(-1)  # (n, V), position t predicts token t+1
            tgt = torch.tensor(targets[i], device=logp.device)  # (n,)
            sums.append(logp.gather(-1, tgt[:, None]).sum())
            greedy.append((logp.argmax(-1) == tgt).all())
        for i, v, g in zip(batch, torch.stack(sums).tolist(), torch.stack(greedy).tolist()):  # one sync per batch
            results[i] = Score(v, len(targets[i]), g)
    return results


@functools.lru_cache(maxsize=8)
def _encoder(enc):
    return DepthBenchLM(tokenizer=enc)


def encode_pair(enc, context, continuation):
    """(context, continuation) strings -> (ctx_ids, cont_ids), two lists of ints, as the harness
    encodes a loglikelihood request (TemplateLM._encode_pair; for an empty context,
    TemplateLM.loglikelihood's rule): trailing whitespace of the context moves to the
    continuation; whole = encode(context + continuation); the continuation's tokens are
    whole[len(encode(context)):]; an empty context becomes [enc.eot]. Raises ValueError if
    the continuation has no tokens of its own."""
    lm = _encoder(enc)
    if context == '':
        cont = lm.tok_encode(continuation)
        ctx, cont = ([lm.prefix_token_id], cont) if not cont or cont[0] != lm.prefix_token_id else (cont[:1], cont[1:])
    else:
        ctx, cont = lm._encode_pair(context, continuation)
    if not cont:
        raise ValueError(f"continuation {continuation!r} has no tokens of its own; every answer must be non-empty")
    return ctx, cont

# -----------------------------------------------------------------------------
# the lm_eval model


class DepthBenchLM(TemplateLM):
    """An lm_eval model (lm_eval.api.model.TemplateLM) for this project's checkpoints, any scheme.

    DepthBenchLM(ckpt=PATH) loads a checkpoint as sample.py does (checkpoint.load_model: the
    sha256 verified, its fast paths checked, its tokenizer); DepthBenchLM(model=GPT,
    tokenizer='gpt2' | 'byte' | path | a Tokenizer) wraps a model in memory; DepthBenchLM(
    logits_fn=f, tokenizer=..., max_length=T) scores with any (B, T) -> (B, T, V) function (a
    model with blocks skipped: loglikelihood requests only). The context is the model's
    block_size (max_length); longer requests keep their last tokens. Greedy generation
    (temperature 0 or do_sample False) is deterministic; sampling draws with seed 1234.
    batch_size: sequences per forward of the loglikelihood requests (an int; 'auto' is not
    supported). allow_unsealed=True reads a checkpoint without a seal (another tool's), unverified.
    Raises ValueError (one line) for a bad argument or a damaged, cut-off or unsealed checkpoint.
    """

    def __init__(self, ckpt=None, *, model=None, tokenizer=None, logits_fn=None, max_length=None, device=None,
                 batch_size=8, max_batch_size=None, dtype=None, fast='auto', kv_cache=True, max_gen_toks=256,
                 seed=1234, allow_unsealed=False, **unused):
        super().__init__()
        if unused:
            raise ValueError(f"DepthBenchLM does not take {', '.join(sorted(unused))}; model_args: ckpt, device, "
                             f"dtype, tokenizer, fast, kv_cache, max_gen_toks, batch_size, allow_unsealed")
        if device is not None and str(device).startswith('cuda') and not torch.cuda.is_available():
            # the harness's command line passes --device, cuda:0 unless told: as its HFLM, use the CPU
            print(f"DepthBenchLM: device {device} but CUDA is not available here: running on the CPU", file=sys.stderr)
            device = 'cpu'
        if ckpt is not None:
            from checkpoint import load_model, tokenizer_name_for
            from sample import checkpoint_path
            device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
            try:
                model, info = load_model(checkpoint_path(str(ckpt), ''), device=device, fast=fast,
                                         unsealed=allow_unsealed in (True, 'True', 'true', '1'))
            except ValueError as e:  # the loader names train.py's flag; the harness takes it in model_args
                raise ValueError(str(e).replace('pass --allow_unsealed=True', 'add allow_unsealed=True to --model_args')) from None
            tokenizer = tokenizer or info.get('tokenizer') or tokenizer_name_for(info)
        if isinstance(tokenizer, (str, Path)):
            from data.tokenizer import get_tokenizer
            tokenizer = get_tokenizer(str(tokenizer))
        if tokenizer is None:
            raise ValueError("DepthBenchLM needs a tokenizer (or a ckpt that records one)")
        self.enc, self.model = tokenizer, model
        if model is not None:
            device = device or next(model.parameters()).device
            max_length = max_length or model.config.block_size
            if getattr(tokenizer, 'n_vocab', 0) > model.config.vocab_size:
                raise ValueError(f"tokenizer has {tokenizer.n_vocab:,} ids, more than the model's vocab_size "
                                 f"{model.config.vocab_size:,}: pass the tokenizer the model was trained with")
        self._device = torch.device(device or 'cpu')
        self._max_length = max_length or 2048
        if isinstance(batch_size, str) and not batch_size.isdigit():
            raise ValueError(f"batch_size={batch_size!r}: give a number of sequences (e.g. 8)")
        self.batch_size = int(batch_size)
        dtype = dtype or ('bfloat16' if self._device.type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32')
        if dtype not in ('float32', 'bfloat16', 'float16'):
            raise ValueError(f"dtype={dtype!r}: use float32, bfloat16 or float16")
        self.dtype = dtype
        self.logits_fn = logits_fn or (self._logits if model is not None else None)
        self.kv_cache, self.max_gen_toks, self.seed = bool(kv_cache), int(max_gen_toks), int(seed)

    def _autocast(self):
        return nullcontext() if self.dtype == 'float32' else \
            torch.autocast(self._device.type, dtype=getattr(torch, self.dtype))

    def _logits(self, idx):
        with self._autocast():
            return self.model(idx)[0]  # (B, T, V)

    # what TemplateLM asks for -------------------------------------------------

    @property
    def eot_token_id(self):
        return self.enc.eot

    @property
    def max_length(self):
        return self._max_length

    @property
    def tokenizer_name(self):
        return getattr(self.enc, 'name', type(self.enc).__name__)

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        """Ordinary text -> ids, no special tokens (the project's tokenizers never add any)."""
        return self.enc.encode(string)

    def tok_decode(self, tokens, **kwargs):
        return self.enc.decode([tokens] if isinstance(tokens, int) else list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: [((context, continuation), ctx_ids, cont_ids)] -> [(logprob, is_greedy)]."""
        if self.logits_fn is None:
            raise ValueError("DepthBenchLM without a model or logits_fn cannot score")
        scores = continuation_logprobs(self.logits_fn, self.enc, [(c, x) for _, c, x in requests],
                                       batch_size=self.batch_size, max_len=self.max_length, device=self._device,
                                       progress=not disable_tqdm, desc='loglikelihood')
        for (key, _, _), s in zip(requests, scores):
            if key is not None:
                self.cache_hook.add_partial('loglikelihood', key, (s.logprob, s.greedy))
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """The log-likelihood (nats) of each whole string, scored in the harness's disjoint
        windows of max_length tokens (lm_eval.utils.get_rolling_token_windows, context_len 1,
        as HFLM): the first token is conditioned on the end-of-text token."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), *w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial('loglikelihood_rolling', (req.args[0],), total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        """Each request's continuation of its context, one token at a time on the KV cache
        (sample.stream; kv_cache=False recomputes the context for every token, the same tokens),
        until a stop string of gen_kwargs['until'] or the end-of-text token appears, or
        max_gen_toks tokens; the text is cut before the first stop string (lm-eval's rule)."""
        from sample import stream
        if self.model is None:
            raise ValueError("generate_until needs a model (DepthBenchLM(ckpt=...) or model=...), not a logits_fn")
        eos = self.tok_decode([self.eot_token_id])
        out = []
        for req in tqdm(requests, desc='generate_until', disable=disable_tqdm or None):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop('until', None), eos=eos)
            max_gen = kwargs.pop('max_gen_toks')
            temperature = float(kwargs.get('temperature', 0.0)) if kwargs.get('do_sample') else 0.0
            idx = torch.tensor([self.tok_encode(context) or [self.eot_token_id]], device=self._device)  # (1, T)
            gen = torch.Generator(device=self._device).manual_seed(self.seed)
            ids, text = [], ''
            with self._autocast():
                for nxt in stream(self.model, idx, temperature, None, getattr(self.enc, 'n_vocab', None), gen,
                                  self.kv_cache):
                    if len(ids) == max_gen or nxt.item() == self.eot_token_id:
                        break
                    ids.append(nxt.item())
                    text = self.tok_decode(ids)
                    if any(s and s in text for s in until):
                        break
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial('generate_until', (context, gen_kwargs), text)
            out.append(text)
        return out

    def get_model_info(self):
        cfg = getattr(self.model, 'config', None)
        return {} if cfg is None else {'residual': cfg.residual, 'n_layer': cfg.n_layer, 'n_embd': cfg.n_embd,
                                       'block_size': cfg.block_size, 'kv_cache': self.kv_cache}


# lm-eval imports the class when 'depthbench' is asked for (a lazy entry: registering the class
# itself would clash with the copy a `python -m probes.harness` run defines in __main__). The
# built-in models first: lm-eval fills the registry with them only while it is empty.
import lm_eval.models  # noqa: E402, F401
if 'depthbench' not in model_registry:
    model_registry.register('depthbench', target='probes.harness:DepthBenchLM')

# -----------------------------------------------------------------------------
# the harness's tasks over the project's prepared items (data/evals/prepare.py)


class ItemsTask(ConfigurableTask):
    """A harness task (ConfigurableTask: its requests, metrics, filters) whose test split is a
    list of dicts in memory, not a dataset to download."""

    def __init__(self, items, config):
        self.items = items
        super().__init__(config=config)

    def download(self, *args, **kwargs):
        self.dataset = DatasetDict({'test': Dataset.from_list(self.items)})


def arc_easy_task(items):
    """The harness's ARC-Easy (lm-eval's arc_easy.yaml: zero-shot multiple choice, continuation
    target_delimiter + choice, acc and acc_norm, the latter per character of the choice text)
    over items of data/evals/arc_easy.jsonl, whose prompt is already "Question: ...\\nAnswer:"."""
    return ItemsTask(items, {'task': 'depthbench_arc_easy_items', 'output_type': 'multiple_choice',
                             'test_split': 'test', 'doc_to_text': 'prompt', 'doc_to_choice': 'choices',
                             'doc_to_target': 'gold', 'target_delimiter': ' ',
                             'metric_list': [{'metric': m, 'aggregation': 'mean', 'higher_is_better': True}
                                             for m in ('acc', 'acc_norm')]})


def main():
    """`python -m probes.harness ...`: lm_eval's command line (its arguments, tables and files)
    with 'depthbench' registered; a bad input of ours (a missing checkpoint, bad model_args) is
    one line, not a traceback."""
    import lm_eval.__main__
    try:
        lm_eval.__main__.cli_evaluate()
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {str(e).splitlines()[0]}") from None


if __name__ == '__main__':
    main()
