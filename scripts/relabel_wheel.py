"""Gives a built wheel a local version label, e.g. layerstream-0.1.0 -> layerstream-0.1.0+torch2.13.0.cu130:
the METADATA's Version, the .dist-info folder, the file name and RECORD (every file's sha256 and size again).

    python scripts/relabel_wheel.py WHEEL LABEL OUT_DIR     (prints the new wheel's path)

Used by scripts/build_wheel.sh, so that a wheel says which torch it was built for.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import sys
import zipfile


def relabel(src: str, label: str, out_dir: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9]+(\.[A-Za-z0-9]+)*", label):
        raise ValueError(f"{label!r} is not a PEP 440 local label (letters and digits, separated by dots)")
    name = os.path.basename(src)
    dist, version = name.split("-")[:2]
    if "+" in version:
        raise ValueError(f"{name} already has a local label")
    new_version = f"{version}+{label}"
    old_info, new_info = f"{dist}-{version}.dist-info/", f"{dist}-{new_version}.dist-info/"
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, name.replace(f"-{version}-", f"-{new_version}-", 1))
    records = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            data = zin.read(item)
            path = item.filename.replace(old_info, new_info, 1)
            if path == new_info + "RECORD":
                continue
            if path == new_info + "METADATA":
                data, count = re.subn(rb"(?m)^Version: .*$", f"Version: {new_version}".encode(), data, count=1)
                if count != 1:
                    raise ValueError(f"{name}: METADATA has no Version line")
            info = zipfile.ZipInfo(path, item.date_time)
            info.external_attr, info.compress_type = item.external_attr, zipfile.ZIP_DEFLATED
            zout.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append((path, f"sha256={digest}", str(len(data))))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(records + [(new_info + "RECORD", "", "")])
        zout.writestr(new_info + "RECORD", buf.getvalue())
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    print(relabel(*sys.argv[1:]))
