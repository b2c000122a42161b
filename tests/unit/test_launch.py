"""The launch layer without running jobs: a study's neutral ``resources:`` as each launcher's own
form (the submissions a dry run prints), scheduler extras kept apart, the older ``sbatch:`` keys
read with one notice, bad resources named by key, and the launchers found by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megatron_ext.cli import run_study
from megatron_ext.config_loading import ConfigError
from megatron_ext.launch import LAUNCHERS, Launcher, launcher_class, script
from megatron_ext.study.spec import read_study

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "recipes" / "base" / "tiny.yaml"


def _study(tmp_path: Path, **fields) -> Path:
    size = {"name": "tiny", "base": str(TINY), **fields.pop("size", {})}
    study = {"name": "res", "sizes": [size], "budgets": [600, 300], "objectives": [{"objective": "clm"}],
             "output": {"save": str(tmp_path / "out" / "{run}"), "log_dir": str(tmp_path / "log" / "{run}")},
             **fields}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def _submissions(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.startswith("  ") and "--config" in line]


def test_neutral_resources_become_each_launchers_form(tmp_path, capsys):
    study = _study(tmp_path, resources={"nodes": 2, "gpus_per_node": 4, "time": "1:00:00",
                                        "slurm": ["--partition=gpu", "--account=lab"]},
                   size={"resources": {"nodes": 4, "slurm": ["--qos=high"]}})
    study_dir = tmp_path / "study_dir"
    assert run_study.main([str(study), "--launcher", "slurm", "--study-dir", str(study_dir), "--dry-run",
                           "--sbatch-arg=--time=5"]) == 0
    out = capsys.readouterr()
    first, branch = _submissions(out.out)
    # neutral flags (the size's nodes over the study's), the study's extras then the size's, the command line's
    flags = "--nodes=4 --gpus-per-node=4 --time=1:00:00 --partition=gpu --account=lab --qos=high --time=5"
    assert first == (f"sbatch --parsable --job-name=res.tiny_clm_600 --output={study_dir.resolve()}/logs/tiny_clm_600-%j.out "
                     f"{flags} --kill-on-invalid-dep=yes {script('slurm.sbatch')} --config "
                     f"{study_dir / 'recipes' / 'tiny_clm_600.yaml'}")
    assert f"--kill-on-invalid-dep=yes --dependency=afterok:<job of tiny_clm_600> {script('slurm.sbatch')}" in branch
    assert "notice" not in out.err

    # The local launcher runs one node: the study's nodes are refused, its GPUs per node are torchrun's
    # processes unless --nproc-per-node says otherwise.
    assert run_study.main([str(study), "--launcher", "local", "--study-dir", str(study_dir), "--dry-run"]) == 2
    assert "job res.tiny_clm_600: the local launcher runs one node, the job asks for 4 (resources.nodes)" \
        in capsys.readouterr().err
    study = _study(tmp_path, resources={"gpus_per_node": 4, "slurm": ["--partition=gpu"]})
    assert run_study.main([str(study), "--launcher", "local", "--study-dir", str(study_dir), "--dry-run"]) == 0
    first, _ = _submissions(capsys.readouterr().out)
    assert re.fullmatch(rf"GPUS_PER_NODE=4 PYTHON=\S+ RECIPE= bash {script('single_node.sh')} --config \S+", first)
    assert run_study.main([str(study), "--launcher", "local", "--study-dir", str(study_dir), "--dry-run",
                           "--nproc-per-node", "1"]) == 0
    out = capsys.readouterr()
    first, _ = _submissions(out.out)
    assert re.fullmatch(r"\S+python\S* -m megatron_ext\.cli\.pretrain_encoder --config \S+/tiny_clm_600\.yaml", first), first


@pytest.mark.parametrize("fields, where", [
    ({"sbatch": ["--partition=gpu"]}, "study: unknown key(s) ['sbatch']"),
    ({"size": {"sbatch": ["--nodes=8"]}}, "study.sizes[0]: unknown key(s) ['sbatch']"),
    ({"evaluation": {"tasks": ["rt_sentiment"], "sbatch": ["--gpus=1"]}}, "study.evaluation: unknown key(s) ['sbatch']"),
])
def test_an_older_sbatch_key_is_refused_in_one_line_naming_the_resources_key(tmp_path, fields, where):
    with pytest.raises(ConfigError) as err:
        read_study(_study(tmp_path, **fields))
    assert where in str(err.value) and "'resources'" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("fields, message", [
    ({"resources": {"nodes": 0}}, "study.resources: nodes: expected at least 1, got 0"),
    ({"resources": {"gpus": 1}}, "study.resources: unknown key(s) ['gpus']; valid keys: ['gpus_per_node', 'nodes', "
                                 "'time'] and the launchers' extra flags ['local', 'slurm']"),
    ({"resources": {"time": "soon"}}, "time: expected minutes, HH:MM:SS or D-HH:MM:SS, got 'soon'"),
    ({"resources": {"slurm": ["gpu"]}}, "study.resources.slurm: 'gpu' is not an sbatch option"),
    ({"resources": {"local": ["--x"]}}, "study.resources.local: the local launcher takes no extra flags"),
    ({"size": {"resources": {"nodes": "two"}}}, "study.sizes[0].resources.nodes: expected an integer, got 'two'"),
])
def test_bad_resources_name_the_key(tmp_path, fields, message):
    with pytest.raises(ConfigError) as err:
        read_study(_study(tmp_path, **fields))
    assert message in str(err.value) and "study.yaml" in str(err.value), str(err.value)


def test_every_registered_launcher_is_a_launcher_with_its_own_options():
    import argparse

    parser = argparse.ArgumentParser()
    for name in LAUNCHERS:
        cls = launcher_class(name)
        assert issubclass(cls, Launcher) and cls.name == name
        cls.add_arguments(parser.add_argument_group(name))  # argparse refuses an option given twice
    with pytest.raises(Exception, match="no launcher named 'pbs'; the launchers: local, slurm"):
        launcher_class("pbs")


def test_an_evaluation_grid_is_one_array_job_with_its_workers_resources(tmp_path):
    from megatron_ext.launch.slurm import SlurmLauncher
    from megatron_ext.study.evaluation import EvaluationStage
    from megatron_ext.study.state import StudyDir
    from megatron_ext.study.plan import plan_study

    path = _study(tmp_path, resources={"gpus_per_node": 8, "time": "24:00:00", "slurm": ["--partition=gpu"]},
                  evaluation={"tasks": ["rt_sentiment"], "workers": 3, "output_dir": str(tmp_path / "eval"),
                              "resources": {"gpus_per_node": 1, "time": "2:00:00", "slurm": ["--cpus-per-task=4"]}})
    plan = plan_study(read_study(path), path)
    launcher = SlurmLauncher()
    stage = EvaluationStage(plan, StudyDir(root=tmp_path / "sd"), launcher)
    (grid,) = stage.grids.values()
    command = launcher.describe(stage.job(grid), ["7", "8"])
    assert command.startswith(f"sbatch --parsable --array=0-2 --job-name=res.eval.runs --output="
                              f"{(tmp_path / 'sd' / 'logs' / 'evaluation').resolve()}/runs-%A_%a.out --gpus=1 "
                              "--time=2:00:00 --partition=gpu --cpus-per-task=4 --kill-on-invalid-dep=yes "
                              f"--dependency=afterok:7:8 {script('evaluate.sbatch')} --models "), command
    assert launcher.log_file(stage.job(grid), "9") == tmp_path / "sd" / "logs" / "evaluation" / "runs-9_0.out"


def test_a_script_job_is_one_process_of_a_python_file_under_either_launcher(tmp_path):
    """A job's program is a module of the package or, for a file of a checkout (the GPU suite), a
    script: SLURM runs it through the packaged ``program.sbatch``, the local launcher as one process."""
    from megatron_ext.config_loading import UserError
    from megatron_ext.launch import Job, JobEvents, Resources
    from megatron_ext.launch.local import LocalLauncher
    from megatron_ext.launch.slurm import SlurmLauncher

    program = tmp_path / "program.py"
    program.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).write_text(' '.join(sys.argv[2:]))\n")
    job = Job(name="one", script=program, args=(str(tmp_path / "said"), "a", "b"), log=tmp_path / "logs" / "one",
              resources=Resources(nodes=1, gpus_per_node=1, time="0:30"))
    assert SlurmLauncher().describe(job, ["5"]) == (
        f"sbatch --parsable --job-name=one --output={tmp_path}/logs/one-%j.out --nodes=1 --gpus=1 --time=0:30 "
        f"--kill-on-invalid-dep=yes --dependency=afterok:5 {script('program.sbatch')} {program} {tmp_path}/said a b")
    with pytest.raises(UserError, match=f"job one: the slurm launcher starts one process per GPU for .* not {program}"):
        SlurmLauncher().describe(Job(name="one", script=program, log=job.log, per_gpu=True), [])
    with pytest.raises(ValueError, match="job one: give its program as module or as script, exactly one"):
        Job(name="one", module="megatron_ext.cli.evaluate", script=program, log=job.log)
    with pytest.raises(ValueError, match="job one: script must be an absolute path, got program.py"):
        Job(name="one", script=Path("program.py"), log=job.log)

    local = LocalLauncher()
    job_id = local.submit(job)
    assert local.follow([job_id], JobEvents()) is None
    assert local.state(job_id).succeeded and (tmp_path / "said").read_text() == "a b"
    assert local.log_file(job, job_id).read_text().startswith("=== ")


@pytest.mark.parametrize("time, seconds", [("4", 240), ("1:30", 90), ("1:00:00", 3600), ("2-3", 51 * 3600),
                                           ("1-0:10", 86400 + 600), ("1-00:00:05", 86405), (None, None)])
def test_a_time_limit_in_seconds_reads_each_form_as_slurm_does(time, seconds):
    from megatron_ext.launch import Resources

    assert Resources(time=time).time_s == seconds


def test_following_slurm_jobs_reports_the_change_that_ended_the_last_one(monkeypatch):
    """The last job ends between a look and the loop's check of the queue: one more look reports it."""
    from megatron_ext.launch import JobState
    from megatron_ext.launch.slurm import SlurmLauncher, SlurmOptions

    launcher = SlurmLauncher(SlurmOptions(poll_interval=0.01))
    queue = iter([JobState(status="running", detail="RUNNING"), JobState(status="ended", succeeded=True, detail="COMPLETED")])
    monkeypatch.setattr(launcher, "states", lambda job_ids: {job_id: next(queue) for job_id in job_ids})
    looks = []

    class Events:
        def poll(self):
            looks.append(len(looks))

    assert launcher.follow(["7"], Events()) is None
    assert len(looks) == 2  # after the running look, and once the queue says it ended
