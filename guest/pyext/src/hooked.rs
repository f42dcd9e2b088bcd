//! `_bud.Hooked`: a callable that runs a hook before the function it stands in for.
//!
//! The worker replaces a few `os` functions (`os.write`, `os.read`, `os.waitpid`,
//! `os._exit`...) with these to notice what a job does below Python's level (see
//! `guest/python/bud_io.py`). It is native on purpose: a Python wrapper would be a frame of
//! the worker in every traceback through those functions (`os.write(99, b"")` would show
//! `File ".../bud_io.py", in wrapper`), and jobs must see tracebacks as `python3 -c` prints
//! them. A native call adds no frame; only the hook's own frame exists, and only while it
//! runs (hooks never raise).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// `Hooked(original, hook)`: calling it calls `hook(args, kwargs)` (kwargs None when there
/// are none) and then returns `original(*args, **kwargs)`. Attribute reads other than
/// `__wrapped__` go to `original` (`os.write.__name__` stays `"write"`).
#[pyclass(module = "_bud", frozen)]
#[derive(Debug)]
pub struct Hooked {
    original: Py<PyAny>,
    hook: Py<PyAny>,
}

#[pymethods]
impl Hooked {
    #[new]
    fn new(original: Py<PyAny>, hook: Py<PyAny>) -> Self {
        Self { original, hook }
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        self.hook.call1(py, (args, kwargs))?;
        self.original.call(py, args, kwargs)
    }

    /// The function this stands in for.
    #[getter]
    fn __wrapped__(&self, py: Python<'_>) -> Py<PyAny> {
        self.original.clone_ref(py)
    }

    fn __getattr__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        self.original.getattr(py, name)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("<hooked {}>", self.original.bind(py).repr()?))
    }
}
