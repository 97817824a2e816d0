"""``summary.json``'s one writer and one reader (megatron_mech.records.run_summary): a summary the hook filled is read
back as it was written; the reader refuses, naming the file and the field, a summary of another schema version, one
without a version (the two schemas written before), a field missing, unknown or of the wrong type."""
import json

import pytest

from run_summaries import SCHEMA, assert_summary_schema, write_summary_file
from megatron_mech.core.detect import Alert
from megatron_mech.records.run_summary import RunSummary, read_run_summary


def test_a_hooks_summary_is_read_back_as_written(tmp_path):
    from megatron_mech.config import MechConfig
    from megatron_mech.hook import MechHook

    hook = MechHook(MechConfig())
    alert = Alert("attn/layer1/head0/delta2_entropy", "attention", 4, 0.01, 0.25, 9.0,
                  {"layer": 1, "head": 0, "term": "delta2"})
    summary = hook.run_summary(alerts=[alert], step_seconds=[0.5, 0.25], model="llama", world=2)
    path = write_summary_file(tmp_path / "summary.json", **{name: getattr(summary, name) for name in SCHEMA})
    raw, read = assert_summary_schema(path, trainer_keys={"model", "world"})
    assert read.to_dict().keys() == raw.keys()
    assert read.trainer == {"model": "llama", "world": 2} and read.step_seconds == [0.5, 0.25]
    assert read.alerts == [alert.to_dict()]
    assert read.diagnosis["step"] == 4 and read.verdict == summary.verdict
    assert read.detectors == hook.arming()
    assert read.monitor_share == pytest.approx(read.monitor_seconds / 0.75)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("schema_version"), "has no 'schema_version'"),
    (lambda d: d.update(schema_version=2), "has schema_version 2; this version of megatron-mech reads schema_version 1"),
    (lambda d: d.update(schema_version=True), "has schema_version True"),
    (lambda d: d.pop("trainer"), "lacks 'trainer'"),
    (lambda d: d.update(monitor_parts={}), "has unknown 'monitor_parts'"),
    (lambda d: d.update(alerts="symptom/loss"), "field 'alerts' must be list, got str"),
    (lambda d: d.update(final_step=4.0), "field 'final_step' must be int, got float"),
    (lambda d: d.update(optimizer_steps_skipped=False), "field 'optimizer_steps_skipped' must be int, got bool"),
    (lambda d: d.update(verdict=None), "field 'verdict' must be str, got NoneType"),
])
def test_the_reader_refuses_another_schema_naming_the_file_and_the_field(tmp_path, change, message):
    path = write_summary_file(tmp_path / "summary.json")
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="summary") as error:
        read_run_summary(path)
    assert str(path) in str(error.value) and message in str(error.value), str(error.value)


def test_the_reader_refuses_what_is_not_a_summary_by_name(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{path}: the run's summary is not a JSON object"):
        read_run_summary(path)
    path.write_text("{")
    with pytest.raises(ValueError, match=f"{path}: cannot read the run's summary"):
        read_run_summary(path)


def test_the_writer_the_reader_and_the_documented_schema_have_the_same_fields():
    import dataclasses
    import re

    from dist_utils import REPO_ROOT
    from megatron_mech.records import run_summary

    fields = [f.name for f in dataclasses.fields(RunSummary)]
    assert set(fields) == set(run_summary._TYPES) == set(SCHEMA)
    documented = re.findall(r"^\| `(\w+)` \| ", (REPO_ROOT / "docs" / "outputs.md").read_text(), flags=re.M)
    assert sorted(documented) == sorted(fields)


def test_nullable_fields_may_be_null(tmp_path):
    path = write_summary_file(tmp_path / "summary.json", step_seconds=None, diagnosis=None)
    read = read_run_summary(path)
    assert isinstance(read, RunSummary) and read.step_seconds is None and read.monitor_share is None
