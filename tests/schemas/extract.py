"""Write a CRD's OpenAPI schema as the JSON kept here (the suite reads these files, no network).

    python tests/schemas/extract.py GIT_DIR TAG CRD_PATH VERSION OUT.json

GIT_DIR is a clone of the CRD's repository (kubeflow/trainer); the schema is
`spec.versions[name == VERSION].schema.openAPIV3Schema` of CRD_PATH at TAG, verbatim but for its
`description` texts, dropped to keep the files small (no validation reads them). The source (repository,
tag, commit, path) goes into the file under `x-source`, which validation ignores like every `x-` key.
"""

import json
import subprocess
import sys

import yaml


def without_descriptions(node, in_properties=False):
    # A key named "description" inside `properties` is a field of the resource, not the keyword: keep it.
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: without_descriptions(value, in_properties=key == "properties" and not in_properties)
            for key, value in node.items() if in_properties or key != "description"}


def main(git_dir, tag, crd_path, version, out):
    git = ["git", "-C", git_dir]
    commit = subprocess.run([*git, "rev-parse", f"{tag}^{{commit}}"], capture_output=True, text=True,
                            check=True).stdout.strip()
    text = subprocess.run([*git, "show", f"{commit}:{crd_path}"], capture_output=True, text=True,
                          check=True).stdout
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    [entry] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = without_descriptions(entry["schema"]["openAPIV3Schema"])
    source = {"repository": "https://github.com/kubeflow/trainer", "tag": tag, "commit": commit,
              "path": crd_path, "crd": crd["metadata"]["name"], "version": version,
              "group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
              "changed": "description texts dropped; nothing else"}
    with open(out, "w") as f:
        json.dump({"x-source": source, **schema}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    main(*sys.argv[1:])
