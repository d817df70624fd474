"""`measure.dtype_kwarg`: transformers before 4.56 takes `torch_dtype` (an unknown `dtype`
reaches the model's `__init__`, which refuses it); 4.56 on takes `dtype`."""

import importlib.util
import unittest
from unittest import mock


@unittest.skipUnless(importlib.util.find_spec("transformers"), "transformers is not installed")
class DtypeKwargTest(unittest.TestCase):
    def test_the_dtype_keyword_follows_the_release(self):
        import transformers

        from headroom_measure import measure

        for version, key in (("4.46.3", "torch_dtype"), ("4.55.4", "torch_dtype"), ("4.56.0", "dtype"), ("5.17.0", "dtype")):
            with self.subTest(version=version), mock.patch.object(transformers, "__version__", version):
                self.assertEqual(measure.dtype_kwarg("bf16"), {key: "bf16"})


if __name__ == "__main__":
    unittest.main()
