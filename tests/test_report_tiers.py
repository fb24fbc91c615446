"""The run report says where each planned component's weights are: resident, or streamed from host or disk."""

import torch

import memfit
from memfit.models.folder import ModelFolder
from memfit.run.report import RunReport, StageReport
from memfit.sizes import format_bytes
from memfit.testing.runtimes import WeightsOnlyCpu

from conftest import smallest_budget


def test_the_report_says_where_a_streamed_components_bytes_are(tiny_models):
    """Under a budget that streams, the report gives per component the bytes resident and streamed
    from disk (the plan's figures), in the table and in the JSON; a stage that keeps everything names
    its components alone."""
    folder = tiny_models("sd")
    unet = ModelFolder.open(folder).load_stage(["unet"], torch.float32, torch.device("cpu")).unet
    unet_bytes = sum(p.numel() * p.element_size() for p in [*unet.parameters(), *unet.buffers()])
    forced = {"unet": {"device": unet_bytes // 4, "disk": unet_bytes - unet_bytes // 4}}
    report = RunReport(device="cpu", dtype="fp32", model=folder, stages=[
        StageReport("denoise", ["unet", "scheduler"], 1.0, 2**20, 0, unet_bytes, "rss", planned_peak_bytes=2**20,
                    strategy="batched", tiers=forced),
        StageReport("decode", ["vae"], 1.0, 2**20, 0, 1, "rss", planned_peak_bytes=2**20, strategy="plain",
                    tiers={"vae": {"device": 1}})])
    rows = report.table().splitlines()
    assert (f"unet ({format_bytes(unet_bytes // 4)} resident, {format_bytes(unet_bytes - unet_bytes // 4)} "
            "from disk), scheduler") in rows[2]
    assert rows[3].split()[:2] == ["decode", "vae"]
    assert report.to_dict()["stages"][0]["tiers"] == forced

    kwargs = dict(prompt="a red circle", model=folder, steps=2, guidance=4.0, width=64, height=64, device=WeightsOnlyCpu())
    budget = smallest_budget(**kwargs)
    stage = memfit.generate(budget=budget, progress=False, **kwargs).report.stages[1]
    assert stage.stage == "denoise" and stage.tiers["unet"].get("disk", 0) > 0
    assert sum(stage.tiers["unet"].values()) == unet_bytes
