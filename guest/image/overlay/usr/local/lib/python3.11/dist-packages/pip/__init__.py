"""pip, loaded from /usr/lib/python3/pip.zip: Debian's pip compiled into one archive by bud's
image builder (guest/src/zipped.rs). This package only points there, so that `import pip`
and `python3 -m pip` find it without the archive on every interpreter's sys.path (each
interpreter would read its directory of ~800 entries at start). `pip install --upgrade pip`
replaces this directory with a real pip, as anywhere else."""

import zipimport

__path__ = ["/usr/lib/python3/pip.zip/pip"]
exec(zipimport.zipimporter(__path__[0]).get_code("__init__"), globals())
