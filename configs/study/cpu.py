"""Paper A (and, in stage 2, paper B) at CPU scale: ``python -m launch.study configs/study/cpu.py``.

Every model is the CPU recipe of ``fibjax.recipes.cpu`` (d_model 128, 8 layers, seq 256, Fibonacci
rungs bounded by the training length) with only the attention differing, trained on data/cpu
(docs/guides/your-own-data.md "5. The papers' and the CPU study's data") for 2,000 steps x 4,096 tokens = 8.2M tokens, with validation
curves every 250 steps; evaluated at 1x, 2x and 4x on 131,072 held-out tokens per dataset.
Stage 3 continues paper B's FullAttn and SSA models of stage 2 at 1,024 tokens (``init_from``).
Stage 4 trains dense, fixed W8 and stagger W8 again for 4x the tokens (8,000 steps, 32.8M).
Stage 5 sets Fibonacci against what practitioners use instead: a window of equal cost, the dense
models under a window, attention sinks and RoPE scaling, and shifted against soft rungs.
"""

from fibjax.eval.groups import FigureGroup
from fibjax.eval.paired import Comparison
from fibjax.eval.seed_table import SeedRow, SeedTable
from fibjax.eval.token_curve import Difference, TokenCurve
from fibjax.eval.trend import Trend
from fibjax.study import Study, StudyRun

COMMON = ("steps=2000", "checkpoint.every_steps=250", "eval.every_steps=250", "eval.max_tokens=131072")
SEED2 = ("seed=43",)
SPARSE = (("--inference-mode", "sparse"),)
# Paper B's continual training to a longer context at CPU scale: the 256-token models continued
# at 1024 for 300 steps of the same 4,096 tokens (1.2M tokens), a fresh optimizer (init_from).
YARN_256 = ("--rope", "scaling=yarn", "factor=4", "original_len=256")
YARN_1024 = ("--rope", "scaling=yarn", "factor=4", "original_len=1024")
# Paper B's error law: ||o_sparse - o_full|| against the dropped mass, per layer, under MoBA inference
ERROR_LAW = ("--inference-mode", "sparse", "--dropped-mass", "--max-tokens", "32768")
# Beyond paper A's 4x: the same scored tokens at 1x, 8x and 16x (131,072 is a multiple of 4,096)
LONG = ("--lengths", "256,2048,4096")
# The five-seed test (BUILD_NOTES, "The five-seed test"): seeds 44-46 of fixed and stagger in
# pairs, then learned, then a dense run for the 16x comparison; all from one commit.
SEEDS = (44, 45, 46)
# The interpolation control: the learned path's interpolated rungs with alpha frozen at 0.99
FROZEN = "configs/study/fib_frozen099_w8.py"
# The scale trend (runs added after the five-seed test): validation curves at 1x and 4x against
# tokens seen, 4x on the first 8,192 tokens of each source (about 1% of a run's time)
CURVE = ("eval.curve_multipliers=1,4", "eval.curve_long_tokens=8192")
FULL = (("--inference-mode", "full"),)
# The same 8.2M tokens at 512 (8 x 512 a step), evaluated at 512, 1,024 and 2,048
AT_512 = ("seq_len=512", "global_batch=8", *CURVE)
# Paper B's budget sweep: MoBA inference with 2-32 blocks of 16 at 1x and 4x (SSA improves as the
# receptive field grows, MoBA does not)
BUDGETS = tuple(("--inference-mode", "sparse", "--num-blocks", str(n), "--block-size", "16", "--lengths", "256,1024") for n in (2, 4, 8, 16, 32))
# 4x the tokens: 8,000 steps = 32.8M tokens, the 4x curve every 500 steps (stage 1's recipe otherwise)
TOKENS_4X = ("seed=44", "steps=8000", "checkpoint.every_steps=500", "eval.every_steps=500", *CURVE)
# Against what practitioners use (issue 51; BUILD_NOTES "Against what practitioners use: declared
# before its runs"): the no-training baselines of a dense model at 1x, 4x, 8x and 16x, the same
# scored tokens: a window of 256 keys, StreamingLLM's 4 sinks + 252, YaRN and NTK at x4 and x16
AT_16X = ("--lengths", "256,1024,2048,4096")
BASELINES = (
    ("--attention", "kind=window", "window=256", *AT_16X),
    ("--attention", "kind=sinks", "sinks=4", "window=252", *AT_16X),
    *(("--rope", "scaling=yarn", f"factor={f}", "original_len=256", *AT_16X) for f in (4, 16)),
    *(("--rope", "scaling=ntk", f"factor={f}", *AT_16X) for f in (4, 16)),
)
# ... and the trained baseline at equal cost (16 keys per query, stagger W8's count), with shifted
# or soft: fixed W8's static path at alpha 0.99 against the interpolation control
WINDOW16 = "configs/cpu/window_equal_w8.py"
STATIC = "configs/study/fib_static099_w8.py"
# A dense model retrofitted with Fibonacci stagger attention: 300 steps from dense seed 44
RETROFIT = ("init_from=runs/study/cpu/dense_seed44", "steps=300", "optim.warmup_steps=30", "checkpoint.every_steps=100", "eval.every_steps=50", *CURVE)


# RoPE scaling and the no-training attention kinds, each named for the baselines tables
BASELINE_LABELS = ("window 256", "sinks 4 + window 252", "YaRN x4", "YaRN x16", "NTK x4", "NTK x16")


def baselines_table(name: str, title: str, dense: str, trained: tuple[SeedRow, ...], seeds: tuple[int, ...]) -> SeedTable:
    """The dense run ``dense`` plain and under every no-training baseline, then ``trained``, at 1x-16x."""
    rows = (SeedRow("dense", dense), *(SeedRow(f"dense, {label}", dense, e) for label, e in zip(BASELINE_LABELS, BASELINES, strict=True)), *trained)
    return SeedTable(name, title, rows, seeds, lengths=(256, 1024, 2048, 4096))


def seeded(name: str, config: str, seed: int) -> StudyRun:
    return StudyRun(f"{name}_seed{seed}", config, (f"seed={seed}",), extra_evals=(LONG,))


def continued(name: str) -> tuple[str, ...]:
    return (
        f"init_from=runs/study/cpu/{name}",
        "seq_len=1024",
        "global_batch=4",
        "steps=300",
        "optim.warmup_steps=30",
        "checkpoint.every_steps=100",
        "eval.every_steps=100",
    )


def get_study() -> Study:
    return Study(
        name="cpu",
        workdir="runs/study/cpu",
        results="results/study",
        overrides=COMMON,
        reference="dense",
        comparisons=(
            Comparison("stagger - fixed (W8)", "configs/cpu/fib_stagger_w8.py", "configs/cpu/fib_fixed_w8.py"),
            Comparison("learned - stagger (W8)", "configs/cpu/fib_learned_w8.py", "configs/cpu/fib_stagger_w8.py"),
            # the interpolation control (BUILD_NOTES, declared before its runs): fractional offsets or learning?
            Comparison("frozen 0.99 - fixed (W8)", FROZEN, "configs/cpu/fib_fixed_w8.py"),
            Comparison("learned - frozen 0.99 (W8)", "configs/cpu/fib_learned_w8.py", FROZEN),
            # issue 51, declared before its runs: the window of equal cost, and shifted or soft
            Comparison("stagger - window 16 (W8)", "configs/cpu/fib_stagger_w8.py", WINDOW16),
            Comparison("static 0.99 - fixed (W8)", STATIC, "configs/cpu/fib_fixed_w8.py"),
            Comparison("frozen 0.99 - static 0.99 (W8)", FROZEN, STATIC),
        ),
        # issue 28's second trend: dense and stagger at 256 (every seed) and at 512
        trends=(
            Trend("dense", ("dense", "dense_seed43", "dense_seed44", "dense_512")),
            Trend("fibonacci W8 staggered", ("fib_stagger_w8", *(f"fib_stagger_w8_seed{s}" for s in (43, *SEEDS)), "fib_stagger_w8_512")),
        ),
        # the report's perplexity-vs-length and NLL-by-position figures: 38 evaluations in one
        # figure are unreadable, so one figure per question (the other seeds: paired.png)
        figures=(
            FigureGroup(
                "paper_a",
                "paper A's models at 256 tokens (seed 42)",
                (
                    "dense",
                    "fib_fixed_w8",
                    "fib_stagger_w8",
                    "fib_learned_w8",
                    "fib_coprime_w8",
                    "pow2_fixed_w8",
                    "pow2_stagger_w8",
                    "fib_fixed_w12",
                    "fib_stagger_w12",
                ),
                reference="dense",
            ),
            FigureGroup(
                "long",
                "to 16x, and a dense model retrofitted (seed 44)",
                ("dense_seed44", "fib_fixed_w8_seed44", "fib_stagger_w8_seed44", "fib_learned_w8_seed44", "dense_retrofit_stagger_w8"),
                reference="dense_seed44",
            ),
            FigureGroup("at_512", "trained at 512 tokens", ("dense_512", "fib_stagger_w8_512"), reference="dense_512"),
            # issue 51: dense seed 44 plain and under a window, sinks, YaRN and NTK, beside Fibonacci and
            # the window of equal cost of the same seed
            FigureGroup(
                "baselines",
                "against what practitioners use (seed 44)",
                ("dense_seed44", "fib_fixed_w8_seed44", "fib_stagger_w8_seed44", "window_equal_w8_seed44", "dense_retrofit_stagger_w8"),
                reference="dense_seed44",
            ),
            FigureGroup(
                "paper_b", "paper B's models at 256 tokens", ("ssa_fullattn", "ssa_moba", "ssa_ssa", "ssa_nsa", "ssa_ssa_fib"), reference="ssa_fullattn"
            ),
            FigureGroup("paper_b_1024", "paper B's models continued to 1,024 tokens", ("ssa_fullattn_c1024", "ssa_ssa_c1024"), reference="ssa_fullattn_c1024"),
        ),
        # issue 39: stage 4's runs against tokens seen (dense seed 44 of 8.2M tokens beside them:
        # the same seed and data order, a schedule four times shorter)
        token_curves=(
            TokenCurve(
                "tokens_32m",
                "dense, fixed W8 and stagger W8 for 32.8M tokens (seed 44)",
                ("dense_32m_seed44", "fib_fixed_w8_32m_seed44", "fib_stagger_w8_32m_seed44", "dense_seed44"),
                differences=(
                    Difference("stagger - fixed", "fib_stagger_w8_32m_seed44", "fib_fixed_w8_32m_seed44"),
                    Difference("stagger - dense", "fib_stagger_w8_32m_seed44", "dense_32m_seed44"),
                    Difference("fixed - dense", "fib_fixed_w8_32m_seed44", "dense_32m_seed44"),
                ),
            ),
        ),
        # issue 51: the no-training baselines beside the trained sparse models, over seeds 44-46,
        # and at 32.8M tokens (seed 44)
        seed_tables=(
            baselines_table(
                "baselines",
                "Against what practitioners use: dense without training, beside trained sparse models (8.2M tokens)",
                "dense_seed{seed}",
                (
                    SeedRow("window 16 (trained, equal cost)", "window_equal_w8_seed{seed}"),
                    SeedRow("window 64 (trained)", "window_w64_seed44", seeds=(44,)),
                    SeedRow("fixed W8", "fib_fixed_w8_seed{seed}"),
                    SeedRow("stagger W8", "fib_stagger_w8_seed{seed}"),
                    SeedRow("learned W8", "fib_learned_w8_seed{seed}"),
                    SeedRow("static 0.99 W8", "fib_static099_w8_seed{seed}"),
                    SeedRow("frozen 0.99 W8 (interpolated)", "fib_frozen099_w8_seed{seed}"),
                    SeedRow("dense retrofitted with stagger W8", "dense_retrofit_stagger_w8", seeds=(44,)),
                ),
                SEEDS,
            ),
            baselines_table(
                "baselines_32m",
                "Against what practitioners use after 32.8M tokens (seed 44)",
                "dense_32m_seed{seed}",
                (SeedRow("fixed W8", "fib_fixed_w8_32m_seed{seed}"), SeedRow("stagger W8", "fib_stagger_w8_32m_seed{seed}")),
                (44,),
            ),
        ),
        runs=(
            # stage 1: the headline claims, with a second seed for the noise
            StudyRun("dense", "configs/cpu/dense.py"),
            StudyRun("fib_fixed_w8", "configs/cpu/fib_fixed_w8.py"),
            StudyRun("fib_stagger_w8", "configs/cpu/fib_stagger_w8.py"),
            StudyRun("pow2_fixed_w8", "configs/cpu/pow2_fixed_w8.py"),
            StudyRun("dense_seed43", "configs/cpu/dense.py", SEED2),
            StudyRun("fib_fixed_w8_seed43", "configs/cpu/fib_fixed_w8.py", SEED2),
            StudyRun("fib_stagger_w8_seed43", "configs/cpu/fib_stagger_w8.py", SEED2),
            # the five-seed test: fixed and stagger pairs first (the primary outcome), then learned
            *(seeded(n, f"configs/cpu/{n}.py", s) for s in SEEDS for n in ("fib_fixed_w8", "fib_stagger_w8")),
            *(seeded("fib_learned_w8", "configs/cpu/fib_learned_w8.py", s) for s in SEEDS),
            # dense at 16x, and its 4x curve against tokens seen (the scale trend's dense line at 256)
            StudyRun("dense_seed44", "configs/cpu/dense.py", ("seed=44", *CURVE), extra_evals=(LONG, *BASELINES)),
            # stage 2: the rest of paper A's matrix at W8/W12, and paper B's methods
            StudyRun("fib_learned_w8", "configs/cpu/fib_learned_w8.py", stage=2),
            StudyRun("fib_coprime_w8", "configs/cpu/fib_coprime_w8.py", stage=2),
            StudyRun("fib_fixed_w12", "configs/cpu/fib_fixed_w12.py", CURVE, stage=2, extra_evals=(LONG,)),
            StudyRun("fib_stagger_w12", "configs/cpu/fib_stagger_w12.py", CURVE, stage=2, extra_evals=(LONG,)),
            StudyRun("dense_512", "configs/cpu/dense.py", AT_512, stage=2),
            StudyRun("fib_stagger_w8_512", "configs/cpu/fib_stagger_w8.py", (*AT_512, "model.attention.max_rung=511"), stage=2),
            # NSA's own attention with --dropped-mass: the mass its selected blocks drop (no error law: three gated branches)
            StudyRun("ssa_nsa", "configs/ssa/cpu_nsa.py", CURVE, stage=2, extra_evals=(*FULL, ERROR_LAW)),
            StudyRun("pow2_stagger_w8", "configs/cpu/pow2_stagger_w8.py", CURVE, stage=2),
            StudyRun("ssa_fullattn", "configs/ssa/cpu_fullattn.py", stage=2, extra_evals=(*SPARSE, YARN_256, ERROR_LAW)),
            StudyRun("ssa_moba", "configs/ssa/cpu_moba.py", stage=2, extra_evals=(ERROR_LAW, *BUDGETS)),
            StudyRun("ssa_ssa", "configs/ssa/cpu_ssa.py", stage=2, extra_evals=(*SPARSE, YARN_256, ERROR_LAW, *BUDGETS)),
            StudyRun("ssa_ssa_fib", "configs/ssa/cpu_ssa_fib.py", CURVE, stage=2, extra_evals=SPARSE),
            # the interpolation control at the five-seed test's seeds 44-46
            *(StudyRun(f"fib_frozen099_w8_seed{s}", FROZEN, (f"seed={s}",), stage=2, extra_evals=(LONG,)) for s in SEEDS),
            StudyRun("dense_retrofit_stagger_w8", "configs/cpu/fib_stagger_w8.py", RETROFIT, stage=2, extra_evals=(LONG,)),
            # stage 3: continual training of paper B's FullAttn and SSA from 256 to 1024 tokens,
            # each evaluated at 1x-4x with and without YaRN (and SSA under sparse inference)
            StudyRun("ssa_fullattn_c1024", "configs/ssa/cpu_fullattn.py", continued("ssa_fullattn"), stage=3, extra_evals=(YARN_1024,)),
            StudyRun("ssa_ssa_c1024", "configs/ssa/cpu_ssa.py", continued("ssa_ssa"), stage=3, extra_evals=(*SPARSE, YARN_1024)),
            # stage 4: 4x the tokens (32.8M) for dense, fixed W8 and stagger W8 at seed 44
            *(StudyRun(f"{n}_32m_seed44", f"configs/cpu/{n}.py", TOKENS_4X, stage=4, extra_evals=(LONG,)) for n in ("fib_fixed_w8", "fib_stagger_w8")),
            StudyRun("dense_32m_seed44", "configs/cpu/dense.py", TOKENS_4X, stage=4, extra_evals=(LONG, *BASELINES)),
            # stage 5 (issue 51): the declared primary test's pairs first (window 16 and static 0.99
            # beside the record's stagger, fixed and frozen runs of seeds 44-46), then dense seeds 45
            # and 46 for the no-training baselines, then the "more keys" window of 64
            *(
                StudyRun(f"{name}_seed{s}", config, (f"seed={s}",), stage=5, extra_evals=(LONG,))
                for s in SEEDS
                for name, config in (("window_equal_w8", WINDOW16), ("fib_static099_w8", STATIC))
            ),
            *(StudyRun(f"dense_seed{s}", "configs/cpu/dense.py", (f"seed={s}", *CURVE), stage=5, extra_evals=(LONG, *BASELINES)) for s in (45, 46)),
            StudyRun("window_w64_seed44", "configs/cpu/window_w64.py", ("seed=44",), stage=5, extra_evals=(LONG,)),
        ),
    )
