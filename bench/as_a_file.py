"""`python bench/<script>.py` (run as a file, not as a module): make this checkout importable as the
package critic_adapters, whatever the working directory. A script imports it only when it has no
package (`if __package__ in (None, ""): import as_a_file`): its own folder is then on sys.path.
"""

import importlib.util
import os
import sys

if "critic_adapters" not in sys.modules:
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.util.spec_from_file_location("critic_adapters", os.path.join(_root, "__init__.py"),
                                                   submodule_search_locations=[_root])
    sys.modules["critic_adapters"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["critic_adapters"])
