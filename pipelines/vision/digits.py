"""The vision team's digit classifier: scikit-learn's bundled 8x8 digits, 2-process DDP, a 4-trial sweep."""

from trainyard import ColumnSpec, Distribution, FloatParam, IntParam, ModelSpec, PipelineSpec, SearchSpec, SourceSpec

PIXELS = [f"pixel_{r}_{c}" for r in range(8) for c in range(8)]

digits = PipelineSpec(
    team="vision",
    name="digits",
    description="Handwritten digit classifier (8x8 grey images), a two-layer MLP.",
    source=SourceSpec(prefix="landing/vision/digits", pattern="*.csv"),
    columns={
        **{p: ColumnSpec(dtype="float", min=0, max=16) for p in PIXELS},
        "label": ColumnSpec(dtype="int", domain=list(range(10))),
    },
    target="label",
    min_rows=500,
    model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=12, batch_size=64, monitor="val_acc"),
    search=SearchSpec(
        params={"lr": FloatParam(low=1e-3, high=5e-2, log=True), "hidden": IntParam(low=16, high=128, step=16)},
        n_trials=4,
    ),
    distribution=Distribution(nodes=1, procs_per_node=2, strategy="ddp"),
)
