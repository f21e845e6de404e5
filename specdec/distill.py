"""Distil a small draft model for a target, on the CPU: `specdec distill`.

The recipe (knobs in `DistillConfig`):
1. Prompts from `distill_data` (extraction, JSON tasks, chat), rendered with the target's
   chat template.
2. Responses sampled from the target itself, batched, under each prompt's constraint (or
   none), greedy and at two temperatures. At every response position the target's top-K
   logits are kept: the teacher signal, computed by the same forward that sampled.
3. Draft vocabulary: the target's specials, its first `keep_first_ids` ids (bytes, common
   merges) and the ids most frequent in the data, up to `draft_vocab`; plus one UNK row for
   input ids outside it. A smaller head is most of the draft's saving.
4. Draft: the target's width and attention shape with `layers` blocks, initialised from the
   target (its embedding rows, its first blocks, its final norm).
5. Training: cross-entropy against the target's top-K distribution restricted to the draft
   vocabulary (KL to the target up to a constant), AdamW with warmup + cosine decay,
   checkpoints every `ckpt_every` steps; a rerun resumes from the last one.
6. Export: an mlx-lm model directory (float16 weights) plus `token_map.json`, which
   `specdec.models.load` reads to map draft ids back to the target's.

Every stage writes under `OUT/work/` and is skipped when its output exists, so an
interrupted run picks up where it stopped. Same seed and BLAS: same data, same draft.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import llguidance.numpy as llnp
from llguidance import LLMatcher
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache

from .chat import render_chat
from .distill_data import make_prompts
from .grammar import GrammarCompiler
from .models import TOKEN_MAP_FILE, LoadedModel



@dataclass(frozen=True)
class DistillConfig:
    """Knobs of the recipe; the defaults made the shipped draft (~70 min on 2 cores)."""

    seed: int = 0
    prompts: int = 960          # prompts sampled from the target
    gen_batch: int = 48         # rows decoded together
    max_new: int = 128          # response cap (tokens)
    temps: tuple[float, ...] = (0.0, 0.7, 1.0)  # per-row sampling temperature, cycled
    top_k_teacher: int = 32     # teacher logits kept per position
    draft_vocab: int = 8192     # draft output ids (+1 UNK input row)
    keep_first_ids: int = 512   # always in the draft vocabulary
    layers: int = 2             # draft blocks (width and heads are the target's)
    max_prompt: int = 192       # prompt tokens kept in front of a response when training
    batch_tokens: int = 2048    # tokens per training batch (padded)
    epochs: int = 12
    lr: float = 5e-4
    warmup: int = 100
    ckpt_every: int = 200
    val_frac: float = 0.05


class Progress:
    """A one-line progress bar on stderr (rate and ETA)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.t0, self.done = max(total, 1), label, time.time(), 0

    def update(self, done: int, extra: str = "") -> None:
        self.done = done
        el = time.time() - self.t0
        eta = el / done * (self.total - done) if done else 0.0
        bar = "#" * int(30 * done / self.total)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {done}/{self.total} "
                         f"{el:5.0f}s eta {eta:5.0f}s {extra}   ")
        sys.stderr.flush()
        if done >= self.total:
            sys.stderr.write("\n")


# -- 2. sampling the target ----------------------------------------------------------------

def _head(model: nn.Module, h: mx.array) -> mx.array:
    if getattr(model.args, "tie_word_embeddings", True) and not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def sample_batch(target: LoadedModel, prompts: list[list[int]],
                 matchers: list[LLMatcher | None], temps: list[float], max_new: int,
                 top_k: int, rng: np.random.Generator
                 ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """Sample one response per prompt, batched with left padding.

    Returns, per row, (response ids incl. a final EOS, teacher top-K ids (R, K), their logits
    (R, K)), where row r of the top-K holds the target's logits for response token r.
    """
    model, V = target.model, target.vocab_size
    eos = set(target.eos_token_ids)
    B, L = len(prompts), max(len(p) for p in prompts)
    pad = [L - len(p) for p in prompts]
    x = np.zeros((B, L), dtype=np.int32)
    for i, p in enumerate(prompts):
        x[i, pad[i]:] = p
    cache = [BatchKVCache(pad) for _ in model.layers]
    h = model.model(mx.array(x), cache=cache)
    logits = _head(model, h[:, -1, :])  # (B, V)
    words = (V + 31) // 32
    bitmask = np.zeros((1, words), dtype=np.int32)
    out: list[list[int]] = [[] for _ in range(B)]
    tk_ids: list[list[np.ndarray]] = [[] for _ in range(B)]
    tk_val: list[list[np.ndarray]] = [[] for _ in range(B)]
    done = [False] * B
    for _ in range(max_new):
        lg = np.array(logits.astype(mx.float32))  # (B, V)
        idx = np.argpartition(-lg, top_k, axis=1)[:, :top_k]
        nxt = np.zeros(B, dtype=np.int32)
        for i in range(B):
            if done[i]:
                continue
            row = lg[i]
            tk_ids[i].append(idx[i].astype(np.int32))
            tk_val[i].append(row[idx[i]].astype(np.float16))
            m = matchers[i]
            if m is not None:
                llnp.fill_next_token_bitmask(m, bitmask, 0)
                allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:V]
                row = np.where(allowed.astype(bool), row, -np.inf)
            if temps[i] <= 0:
                t = int(np.argmax(row))
            else:
                z = row / temps[i]
                p = np.exp(z - z.max())
                t = int(rng.choice(V, p=p / p.sum()))
            out[i].append(t)
            nxt[i] = t
            if m is not None:
                m.consume_token(t)
            if t in eos or (m is not None and (m.is_stopped() or m.is_error())):
                done[i] = True
        if all(done):
            break
        logits = _head(model, model.model(mx.array(nxt)[:, None], cache=cache)[:, -1, :])
    return [(out[i], np.stack(tk_ids[i]), np.stack(tk_val[i])) for i in range(B)]


def generate_data(target: LoadedModel, work: Path, cfg: DistillConfig) -> list[Path]:
    """Stage 2: sample the target on every prompt, one shard file per batch (resumable)."""
    gen_dir = work / "gen"
    gen_dir.mkdir(parents=True, exist_ok=True)
    items = make_prompts(cfg.prompts, cfg.seed)
    compiler = GrammarCompiler.for_hf_tokenizer(target.tokenizer, n_vocab=target.vocab_size,
                                                eos_token_ids=list(target.eos_token_ids))
    rows = []
    for j, it in enumerate(items):
        text = render_chat(target.tokenizer, list(it.messages),
                           constrained=it.constraint is not None)
        ids = list(target.tokenizer.encode(text, add_special_tokens=False))
        rows.append((it.constraint is None, len(ids), j, ids, it.constraint))
    # Similar rows together: constrained (short) apart from free text, by prompt length.
    rows.sort(key=lambda r: (r[0], r[1]))
    batches = [rows[i:i + cfg.gen_batch] for i in range(0, len(rows), cfg.gen_batch)]
    shards = [gen_dir / f"shard_{b:04d}.npz" for b in range(len(batches))]
    bar = Progress(len(batches), "sample")
    for b, batch in enumerate(batches):
        if not shards[b].exists():
            rng = np.random.default_rng([cfg.seed, b])
            matchers = [compiler.compile(r[4]).matcher() if r[4] is not None else None
                        for r in batch]
            temps = [cfg.temps[r[2] % len(cfg.temps)] for r in batch]
            res = sample_batch(target, [r[3] for r in batch], matchers, temps, cfg.max_new,
                               cfg.top_k_teacher, rng)
            _save_shard(shards[b], [r[3] for r in batch], res)
        bar.update(b + 1)
    return shards


def _save_shard(path: Path, prompts: list[list[int]],
                res: list[tuple[list[int], np.ndarray, np.ndarray]]) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp,
             prompt=np.concatenate([np.array(p, np.int32) for p in prompts]),
             prompt_len=np.array([len(p) for p in prompts], np.int32),
             resp=np.concatenate([np.array(r[0], np.int32) for r in res]),
             resp_len=np.array([len(r[0]) for r in res], np.int32),
             tk_ids=np.concatenate([r[1] for r in res]),
             tk_val=np.concatenate([r[2] for r in res]))
    tmp.rename(path)


def load_sequences(shards: list[Path]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray,
                                                     np.ndarray]]:
    """(prompt ids, response ids, teacher top-K ids, teacher top-K logits) per sample."""
    seqs = []
    for s in shards:
        z = np.load(s)
        po = np.concatenate([[0], np.cumsum(z["prompt_len"])])
        ro = np.concatenate([[0], np.cumsum(z["resp_len"])])
        for i in range(len(z["prompt_len"])):
            r = slice(ro[i], ro[i + 1])
            seqs.append((z["prompt"][po[i]:po[i + 1]], z["resp"][r], z["tk_ids"][r],
                         z["tk_val"][r].astype(np.float32)))
    return seqs


# -- 3. the draft vocabulary -----------------------------------------------------------------

def choose_vocab(seqs: list, target: LoadedModel, cfg: DistillConfig) -> list[int]:
    """Draft ids → target ids: specials and the first ids, then the most frequent ones."""
    counts: Counter[int] = Counter()
    for prompt, resp, tk_ids, tk_val in seqs:
        counts.update(prompt.tolist())
        counts.update((resp.tolist()) * 4)  # what the target says matters most
        counts.update(tk_ids[:, :4].ravel().tolist())  # and what it nearly said
    chosen = list(dict.fromkeys([*target.eos_token_ids,
                                 *target.tokenizer.all_special_ids,
                                 *range(min(cfg.keep_first_ids, target.vocab_size))]))
    have = set(chosen)
    for t, _ in counts.most_common():
        if len(chosen) >= cfg.draft_vocab:
            break
        if t not in have and t < target.vocab_size:
            chosen.append(t)
            have.add(t)
    return chosen[:cfg.draft_vocab]


# -- 4/5. the draft and its training ---------------------------------------------------------

def draft_args(target: LoadedModel, cfg: DistillConfig, n_vocab: int) -> dict[str, Any]:
    keep = {k: v for k, v in target.config.items() if not k.startswith("specdec_")}
    return {**keep, "num_hidden_layers": cfg.layers, "vocab_size": n_vocab + 1,
            "tie_word_embeddings": True}


def init_draft(target: LoadedModel, vocab: list[int], cfg: DistillConfig) -> nn.Module:
    """A draft with the target's shape, `cfg.layers` blocks, initialised from the target."""
    args = llama.ModelArgs.from_dict(draft_args(target, cfg, len(vocab)))
    draft = llama.Model(args)
    t = target.model.model
    emb = t.embed_tokens.weight.astype(mx.float32)
    rows = emb[mx.array(vocab)]
    unk = emb.mean(axis=0, keepdims=True)
    params: dict[str, Any] = {"model": {"embed_tokens": {"weight": mx.concatenate([rows, unk])},
                                        "norm": t.norm.parameters(),
                                        "layers": [t.layers[i].parameters()
                                                   for i in range(cfg.layers)]}}
    draft.update(params)
    draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    return draft


@dataclass
class _Example:
    ids: np.ndarray        # (T,) draft input ids
    loss_from: int         # first position whose prediction is trained
    tgt_ids: np.ndarray    # (R, K) draft ids of the teacher's top-K (0 where out of vocab)
    tgt_w: np.ndarray      # (R, K) teacher probabilities (0 where out of vocab)


def build_examples(seqs: list, vocab: list[int], target_vocab: int, cfg: DistillConfig
                   ) -> list[_Example]:
    """Map sequences into draft ids and teacher targets; positions predicting response
    tokens (the last prompt position onward) carry the loss."""
    to_draft = np.full(target_vocab, len(vocab), dtype=np.int32)  # UNK
    to_draft[np.array(vocab)] = np.arange(len(vocab), dtype=np.int32)
    out = []
    for prompt, resp, tk_ids, tk_val in seqs:
        if len(resp) == 0:
            continue
        prompt = prompt[-cfg.max_prompt:]
        seq = np.concatenate([prompt, resp[:-1]])  # the last response token is only a target
        d = to_draft[tk_ids]  # (R, K)
        p = np.exp(tk_val - tk_val.max(axis=1, keepdims=True))
        p = np.where(d < len(vocab), p, 0.0)
        s = p.sum(axis=1, keepdims=True)
        p = np.where(s > 0, p / np.maximum(s, 1e-30), 0.0)
        out.append(_Example(to_draft[seq], len(prompt) - 1, np.where(d < len(vocab), d, 0),
                            p.astype(np.float32)))
    return out


def make_batches(examples: list[_Example], batch_tokens: int, rng: random.Random
                 ) -> list[list[int]]:
    """Indices grouped by length (little padding), batches in a shuffled order."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    batches, cur, longest = [], [], 0
    for i in order:
        n = len(examples[i].ids)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(examples: list[_Example], idx: list[int], K: int
            ) -> tuple[mx.array, mx.array, mx.array]:
    """(ids (B, T), teacher ids (B, T, K), teacher weights (B, T, K)); padding has weight 0."""
    T = max(len(examples[i].ids) for i in idx)
    x = np.zeros((len(idx), T), np.int32)
    ti = np.zeros((len(idx), T, K), np.int32)
    tw = np.zeros((len(idx), T, K), np.float32)
    for b, i in enumerate(idx):
        e = examples[i]
        x[b, :len(e.ids)] = e.ids
        r = len(e.tgt_ids)
        ti[b, e.loss_from:e.loss_from + r] = e.tgt_ids
        tw[b, e.loss_from:e.loss_from + r] = e.tgt_w
    return mx.array(x), mx.array(ti), mx.array(tw)


def soft_ce(model: nn.Module, x: mx.array, ti: mx.array, tw: mx.array) -> mx.array:
    """Mean over trained positions of -sum_k p_teacher(k) log q_draft(k)."""
    logp = nn.log_softmax(model(x), axis=-1)  # (B, T, Vd+1)
    n = mx.maximum((tw.sum(-1) > 0).sum(), 1)
    return -(mx.take_along_axis(logp, ti, axis=-1) * tw).sum() / n


def agreement(model: nn.Module, examples: list[_Example], batches: list[list[int]], K: int
              ) -> float:
    """Fraction of trained positions where the draft's argmax is the teacher's argmax."""
    hit = tot = 0
    for idx in batches:
        x, ti, tw = collate(examples, idx, K)
        pred = mx.argmax(model(x), axis=-1)  # (B, T)
        best = mx.take_along_axis(ti, mx.argmax(tw, axis=-1)[..., None], axis=-1)[..., 0]
        live = tw.max(-1) > 0.0
        hit += int(((pred == best) & live).sum().item())
        tot += int(live.sum().item())
    return hit / max(tot, 1)


def train(draft: nn.Module, train_ex: list[_Example], val_ex: list[_Example], work: Path,
          cfg: DistillConfig) -> dict[str, float]:
    """Stage 5: train with checkpoints every `ckpt_every` steps; resumes from the last."""
    K = cfg.top_k_teacher
    epochs = [make_batches(train_ex, cfg.batch_tokens, random.Random(cfg.seed * 1000 + e))
              for e in range(cfg.epochs)]
    plan = [b for ep in epochs for b in ep]
    total = len(plan)
    sched = optim.join_schedules(
        [optim.linear_schedule(cfg.lr * 0.01, cfg.lr, cfg.warmup),
         optim.cosine_decay(cfg.lr, max(total - cfg.warmup, 1), cfg.lr * 0.1)], [cfg.warmup])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    opt.init(draft.trainable_parameters())
    ckpt, meta_path = work / "ckpt.safetensors", work / "ckpt.json"
    step = 0
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        saved = mx.load(str(ckpt))
        draft.update(tree_unflatten([(k[2:], v) for k, v in saved.items()
                                     if k.startswith("m.")]))
        opt.state = tree_unflatten([(k[2:], v) for k, v in saved.items() if k.startswith("o.")])
        step = int(meta["step"])
        print(f"distill: resumed training at step {step}/{total}", file=sys.stderr)
    val_batches = make_batches(val_ex, cfg.batch_tokens, random.Random(cfg.seed))
    step_fn = nn.value_and_grad(draft, soft_ce)
    bar = Progress(total, "train ")
    ema = None
    while step < total:
        x, ti, tw = collate(train_ex, plan[step], K)
        loss, grads = step_fn(draft, x, ti, tw)
        opt.update(draft, grads)
        mx.eval(draft.parameters(), opt.state, loss)
        step += 1
        ema = float(loss.item()) if ema is None else 0.98 * ema + 0.02 * float(loss.item())
        bar.update(step, f"loss {ema:.3f}")
        if step % cfg.ckpt_every == 0 or step == total:
            flat = [("m." + k, v) for k, v in tree_flatten(draft.parameters())]
            flat += [("o." + k, v) for k, v in tree_flatten(opt.state)]
            mx.save_safetensors(str(work / "ckpt.tmp.safetensors"), dict(flat))
            (work / "ckpt.tmp.safetensors").rename(ckpt)
            meta_path.write_text(json.dumps({"step": step, "total": total}))
    agree = agreement(draft, val_ex, val_batches, K)
    print(f"distill: held-out top-1 agreement with the target {agree:.3f}", file=sys.stderr)
    return {"steps": total, "val_agreement": agree, "loss_ema": ema or 0.0}


# -- 6. export and the whole recipe ----------------------------------------------------------

def export(draft: nn.Module, target: LoadedModel, vocab: list[int], cfg: DistillConfig,
           out: Path, report: dict[str, Any]) -> None:
    """Write the mlx-lm directory: config, float16 weights, tokenizer, token map."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(draft.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    cfgd = draft_args(target, cfg, len(vocab))
    cfgd["specdec_draft"] = {"target": target.name, "recipe": asdict(cfg), **report}
    (out / "config.json").write_text(json.dumps(cfgd, indent=1))
    (out / TOKEN_MAP_FILE).write_text(json.dumps(
        {"target_vocab_size": target.vocab_size, "unk": len(vocab), "draft_to_target": vocab}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target.path / name).exists():
            shutil.copy(target.path / name, out / name)


# What each stage's saved output depends on: a rerun with other values would mix recipes.
_STAGE_FIELDS = {"gen": ("seed", "prompts", "gen_batch", "max_new", "temps", "top_k_teacher"),
                 "vocab.json": ("draft_vocab", "keep_first_ids"),
                 "ckpt.json": ("layers", "max_prompt", "batch_tokens", "epochs", "lr", "warmup",
                               "val_frac")}


def _check_resume(work: Path, cfg: DistillConfig) -> None:
    """Refuse to resume saved stages under different settings (ValueError naming them)."""
    saved_path = work / "config.json"
    if not saved_path.exists():
        return
    saved, now = json.loads(saved_path.read_text()), json.loads(json.dumps(asdict(cfg)))
    for stage, fields in _STAGE_FIELDS.items():
        diff = [f for f in fields if f in saved and saved[f] != now[f]]
        if diff and (work / stage).exists():
            raise ValueError(f"{work.parent} holds a run with different {', '.join(diff)} "
                             f"({', '.join(f'{f}={saved[f]!r}' for f in diff)}); use the same "
                             "settings to resume, or a new --out")


def distill(target: LoadedModel, out: Path, cfg: DistillConfig = DistillConfig()
            ) -> dict[str, Any]:
    """Run the whole recipe (resumable). Returns a report of what was trained and measured."""
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    _check_resume(work, cfg)
    (work / "config.json").write_text(json.dumps(asdict(cfg)))
    mx.random.seed(cfg.seed)
    t0 = time.time()
    shards = generate_data(target, work, cfg)
    seqs = load_sequences(shards)
    t_gen = time.time() - t0
    vocab_path = work / "vocab.json"
    if not vocab_path.exists():
        vocab_path.write_text(json.dumps(choose_vocab(seqs, target, cfg)))
    vocab = json.loads(vocab_path.read_text())
    examples = build_examples(seqs, vocab, target.vocab_size, cfg)
    random.Random(cfg.seed).shuffle(examples)
    n_val = max(1, int(len(examples) * cfg.val_frac))
    val_ex, train_ex = examples[:n_val], examples[n_val:]
    in_vocab = float(np.mean(np.isin(np.concatenate([s[1] for s in seqs]), vocab)))
    print(f"distill: {len(seqs)} samples, {sum(len(s[1]) for s in seqs)} response tokens, "
          f"{in_vocab:.3f} of them in the {len(vocab)}-id draft vocabulary", file=sys.stderr)
    draft = init_draft(target, vocab, cfg)
    t1 = time.time()
    rep = train(draft, train_ex, val_ex, work, cfg)
    report = {"samples": len(seqs), "response_tokens": int(sum(len(s[1]) for s in seqs)),
              "vocab_coverage": round(in_vocab, 4), "sample_s": round(t_gen),
              "train_s": round(time.time() - t1), **{k: round(v, 4) for k, v in rep.items()}}
    export(draft, target, vocab, cfg, out, report)
    return report
