"""tools/profile/netsim_compute.py (scripts/profile_netsim_compute.py) runs (CPU smoke mode, two
cheap kinds) and writes a loadable table whose provenance says what it is; the GPU path cannot run
in CI."""

import numpy as np

from netsim.compute import default_table, load_table
from tools.profile import netsim_compute


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "t.json"
    rc = netsim_compute.main(["--device", "cpu", "--kinds", "router,elementwise", "--max-points", "2", "--replays", "1",
                   "--warmup", "0", "--out", str(out)])  # fmt: skip
    assert rc == 0
    t = load_table(out)
    assert t.provenance["method"] == "cpu-smoke-test" and "NOT a GPU measurement" in t.provenance["note"]
    assert t.provenance["kinds_measured"] == ["router", "elementwise"]
    assert np.all(t.kinds["router"].seconds > 0) and t.kinds["router"].seconds.shape == (2,)
    base = default_table()
    np.testing.assert_array_equal(t.kinds["lm_head"].seconds, base.kinds["lm_head"].seconds)
