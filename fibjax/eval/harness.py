"""A fibjax run in EleutherAI's lm-evaluation-harness (the ``harness`` extra: ``pip install
"fibjax[harness]"``, or ``pip install -e ".[harness]"`` in a clone):

    python -m fibjax.eval.harness --model_args workdir=runs/tiny --tasks lambada_openai

takes ``python -m lm_eval``'s arguments with ``--model fibjax`` (and ``--batch_size auto``)
implied: lm-eval 0.4.13 knows only the models imported in its process and discovers no plugins,
so plain ``python -m lm_eval`` cannot see this one. In Python, importing this module registers
it: ``lm_eval.simple_evaluate(model="fibjax", model_args={"workdir": ...}, tasks=[...])``.

model_args: ``workdir``; ``step`` (default: the latest checkpoint); ``max_length``, the tokens
one forward sees (default: the run's training length); ``max_gen_toks`` (default 256);
``batch_size``, rows per forward ("auto", the default: the run's evaluation budget of
eval.batch_size x seq_len tokens per forward, so short rows go more at a time).

* loglikelihood: lm-eval's causal convention (TemplateLM): context + continuation encoded
  whole and the context's tokens split off. Encoding the continuation alone would be wrong
  here: SentencePiece adds a dummy-prefix space to every encode. An empty context is EOS, which
  starts every document in training (BOS for an imported model that begins its documents with
  it, whose contexts also begin with BOS, as lm-eval's Hugging Face model encodes them). The last max_length + 1 tokens are scored (the context is
  cut from the left), right-padded to a power-of-two bucket: causal, so padding never reaches a
  real position, and each bucket compiles once.
* loglikelihood_rolling: [EOS or BOS] + text in non-overlapping windows of max_length, each scored from
  its own start: fibjax.eval.perplexity's windows, so launch.eval and this agree on the same
  tokens. (lm-eval's HF model scores the same windows but gives the last, shorter one the tokens
  before it as context; here it starts from nothing, like every other window.)
* generate_until: greedy, cached (fibjax.decode), until EOS, an ``until`` string or max_gen_toks.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from fibjax.errors import pip_install

try:
    import lm_eval.models  # noqa: F401  (lm-eval imports its own models only into an empty registry)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import simple_parse_args_string
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"fibjax.eval.harness needs EleutherAI's lm-eval: {pip_install('harness')} ({e})", name=e.name) from None

from fibjax import kinds
from fibjax.decode import GREEDY, Decoder, TextStreamer
from fibjax.eval import batching
from fibjax.model import graphdef_of
from fibjax.run.load import load_run, run_tokenizer

MIN_BUCKET = 16  # shortest padded row: fewer, larger buckets below it would only add compiles


def nll_and_greedy(model, tokens_BL1: jax.Array) -> jax.Array:
    """[B, L, 2] float32: each next token's NLL, and 1.0 where it is the argmax (lm-eval's is_greedy)."""
    logits_BLV = model(tokens_BL1[:, :-1])
    targets_BL = tokens_BL1[:, 1:]
    picked_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    nll_BL = jax.nn.logsumexp(logits_BLV, axis=-1) - picked_BL
    greedy_BL = jnp.argmax(logits_BLV, axis=-1) == targets_BL
    return jnp.stack([nll_BL, greedy_BL.astype(jnp.float32)], axis=-1)


@register_model("fibjax")
class FibjaxLM(TemplateLM):
    def __init__(
        self,
        workdir: str,
        step: int | None = None,
        batch_size: int | str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,
        max_batch_size: int | None = None,
    ):
        del device, max_batch_size  # lm-eval passes them to every model; JAX places this one
        super().__init__()
        run = load_run(str(workdir), None if step is None else int(step))
        self.tok = run_tokenizer(run)  # not ``self.tokenizer``: lm-eval reads that as a Hugging Face tokenizer
        self.run_dir, self.step, self.model_cfg, self.params = str(run.workdir), run.step, run.cfg.model, run.params
        self.max_length = int(max_length or run.cfg.seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.rows = None if batch_size is None or str(batch_size).startswith("auto") else int(batch_size)
        self.rows_tokens = run.cfg.eval.batch_size * run.cfg.seq_len
        # pow2 rungs are reach-matched to the forward's length: score every row at max_length,
        # the decoder's capacity, so the attended set never depends on a bucket
        acfg = self.model_cfg.attention
        self.one_bucket = kinds.kind_of(acfg).length_dependent(acfg)
        self._decoder = None

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> FibjaxLM:
        """model_args win over the --batch_size and --device that lm-eval passes to every model
        (lm-eval's own rule is a duplicate-argument error)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> FibjaxLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def get_model_info(self) -> dict:
        """Which checkpoint was scored, for the results' ``config``."""
        return {"fibjax_workdir": self.run_dir, "fibjax_step": self.step, "fibjax_max_length": self.max_length}

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS for a model that begins its documents with it (an
        imported Llama's), else EOS, which ends the document before every one in fibjax's token files."""
        return self.tok.bos_id if self.tok.add_bos else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Ids of ``string`` as a document begins: after BOS where the source model puts one
        (as lm-eval's Hugging Face model encodes), unless ``add_special_tokens`` is False."""
        return ([] if add_special_tokens is False else self.tok.document_start) + self.tok.encode(string)

    def _bucket(self, length: int) -> int:
        return self.max_length if self.one_bucket else min(self.max_length, max(MIN_BUCKET, 1 << (length - 1).bit_length()))

    def _score(self, rows: list[list[int]], head) -> list[np.ndarray]:
        """``head`` over rows of tokens (inputs and their next-token targets, 2 .. max_length + 1
        long); per row, its outputs at its own positions. Rows of a bucket run batch by batch."""
        fn = batching.on_model(self.model_cfg, head)
        by_bucket, out = collections.defaultdict(list), [None] * len(rows)
        for i, row in enumerate(rows):
            by_bucket[self._bucket(len(row) - 1)].append(i)
        for length, members in sorted(by_bucket.items()):
            tokens_NL1 = np.full((len(members), length + 1), self.eot_token_id, np.int32)
            for r, i in enumerate(members):
                tokens_NL1[r, : len(rows[i])] = rows[i]
            scored = batching.in_fixed_batches(fn, self.params, tokens_NL1, self.rows or max(1, self.rows_tokens // length))
            for r, i in enumerate(members):
                out[i] = scored[r, : len(rows[i]) - 1]
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        for (_, continuation), _, cont in requests:
            if len(cont) > self.max_length:
                raise ValueError(f"the continuation {continuation!r} is {len(cont)} tokens, more than max_length={self.max_length}")
        rows = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in requests]
        results = []
        for scored_T2, (_, _, cont) in zip(self._score(rows, nll_and_greedy), requests):
            tail = scored_T2[len(scored_T2) - len(cont) :]
            results.append((-float(tail[:, 0].sum()), bool(tail[:, 1].all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        streams = [[self.prefix_token_id, *self.tok.encode(r.args[0])] for r in requests]
        rows, owner = [], []
        for n, stream in enumerate(streams):
            for start in range(0, len(stream) - 1, self.max_length):
                rows.append(stream[start : start + self.max_length + 1])
                owner.append(n)
        totals = np.zeros(len(streams))
        for n, nll_T in zip(owner, self._score(rows, batching.next_token_nll)):
            totals[n] += float(nll_T.sum(dtype=np.float64))
        return [-float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = tqdm([r.args for r in requests], "generating", disable=disable_tqdm)
        return [self._generate(context, dict(gen_kwargs)) for context, gen_kwargs in args]

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        if gen_kwargs.get("do_sample"):
            raise NotImplementedError("the fibjax harness model decodes greedily; this task asks for sampling (do_sample=True)")
        until = gen_kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]
        new_tokens = min(int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
        ids = (self.tok_encode(context) if context else [self.prefix_token_id])[-(self.max_length - new_tokens) :]
        decoder, sampler = self._greedy_decoder()
        # prefill a power-of-two head (one compile per size), then feed the rest a token a step
        head = 1 << (len(ids).bit_length() - 1)
        cache, _, next_B = decoder.prefill([ids[:head]], sampler=sampler)
        for pos in range(head, len(ids)):
            cache, _, next_B = decoder.step(cache, [ids[pos]], pos, sampler=sampler)
        streamer, text = TextStreamer(self.tok, ids), ""
        for pos in range(len(ids), len(ids) + new_tokens):
            token = int(next_B[0])
            if token == self.eot_token_id:
                break
            text += streamer.push(token)
            if any(s in text for s in until) or pos + 1 == len(ids) + new_tokens:
                break
            cache, _, next_B = decoder.step(cache, [token], pos, sampler=sampler)
        text += streamer.finish()
        return text[: min([text.find(s) for s in until if s in text], default=len(text))]

    def _greedy_decoder(self) -> tuple[Decoder, object]:
        """Built on first use: a loglikelihood-only evaluation never needs a cache plan (which not
        every attention kind has)."""
        if self._decoder is None:
            self._decoder = Decoder(nnx.merge(graphdef_of(self.model_cfg), self.params), max_len=self.max_length)
        return self._decoder, dataclasses.replace(GREEDY, vocab_size=self.tok.vocab_size)


def main(argv: list[str] | None = None) -> None:
    """``python -m lm_eval run`` with this model registered and ``--model fibjax --batch_size auto`` implied."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = argv[1:] if argv[:1] == ["run"] else argv
    given = {a.split("=")[0] for a in argv if a.startswith("-")}
    implied = [*(["--model", "fibjax"] if "--model" not in given else []), *(["--batch_size", "auto"] if not {"--batch_size", "-b"} & given else [])]
    sys.argv = ["lm-eval", "run", *implied, *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
