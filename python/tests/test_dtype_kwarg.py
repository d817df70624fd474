"""`measure.dtype_kwarg`: transformers before 4.56 takes `torch_dtype` (an unknown `dtype`
reaches the model's `__init__`, which refuses it); 4.56 on takes `dtype`."""
import pytest

transformers = pytest.importorskip("transformers")

from headroom_measure import measure  # noqa: E402


@pytest.mark.parametrize(
    "version, key",
    [("4.46.3", "torch_dtype"), ("4.55.4", "torch_dtype"), ("4.56.0", "dtype"), ("5.17.0", "dtype")],
)
def test_the_dtype_keyword_follows_the_release(monkeypatch, version, key):
    monkeypatch.setattr(transformers, "__version__", version)
    assert measure.dtype_kwarg("bf16") == {key: "bf16"}
