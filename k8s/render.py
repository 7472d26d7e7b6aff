"""Renders a kustomization offline, for the subset of kustomize that specmesh's manifests use.

tests/test_k8s.py validates what this renders, so the manifests are checked on machines without a kustomize
binary; where `kubectl kustomize` exists the test also checks that both render the same objects. Supported,
in kustomize's order: resources (files, directories), configMapGenerator (files, options.labels,
options.disableNameSuffixHash), patches (strategic merge, from a path or inline, matched by kind and name,
including `$patch: delete` of a whole object), namespace, labels (pairs on metadata only) and images (newName,
newTag). Any other kustomization field raises UnsupportedFeature rather than being silently ignored.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILE = "kustomization.yaml"
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "patches", "namespace", "labels", "images"}
SUPPORTED_GENERATOR_OPTIONS = {"labels", "disableNameSuffixHash"}
DELETE_DIRECTIVE = "$patch"
# Lists that strategic merge patches merge element by element, by this key (the Kubernetes API's
# patchMergeKey); every other list is replaced whole, as kustomize does for atomic lists.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath"}
CLUSTER_SCOPED_KINDS = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
POD_SPEC_PATHS = (("spec", "template", "spec"), ("spec", "jobTemplate", "spec", "template", "spec"), ("spec",))

Manifest = dict[str, Any]


class UnsupportedFeature(ValueError):
    """The kustomization uses something this renderer does not implement."""


def render(directory: Path) -> list[Manifest]:
    """The objects `kustomize build directory` would print."""
    directory = Path(directory)
    kustomization = yaml.safe_load((directory / KUSTOMIZATION_FILE).read_text()) or {}
    unsupported = set(kustomization) - SUPPORTED_FIELDS
    if unsupported:
        raise UnsupportedFeature(f"{directory / KUSTOMIZATION_FILE}: unsupported fields {sorted(unsupported)}")
    objects: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else _load_documents(path.read_text())
    objects += [_generate_config_map(directory, spec) for spec in kustomization.get("configMapGenerator", [])]
    for patch in kustomization.get("patches", []):
        objects = _apply_patch(objects, _load_patch(directory, patch))
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED_KINDS:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    for label_set in kustomization.get("labels", []):
        if label_set.get("includeSelectors") or label_set.get("includeTemplates"):
            raise UnsupportedFeature("labels: only metadata labels (no includeSelectors/includeTemplates)")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    for image in kustomization.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _load_documents(text: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _generate_config_map(directory: Path, spec: dict) -> Manifest:
    options = spec.get("options", {})
    if set(spec) - {"name", "files", "options"} or set(options) - SUPPORTED_GENERATOR_OPTIONS:
        raise UnsupportedFeature(f"configMapGenerator {spec.get('name')}: only files, labels, disableNameSuffixHash")
    if not options.get("disableNameSuffixHash"):
        raise UnsupportedFeature(f"configMapGenerator {spec['name']}: name suffix hashes are not implemented")
    metadata: dict[str, Any] = {"name": spec["name"]}
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    data = {Path(name).name: (directory / name).read_text() for name in spec.get("files", [])}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _load_patch(directory: Path, entry: dict) -> Manifest:
    if set(entry) - {"path", "patch"}:
        raise UnsupportedFeature(f"patches: only path or patch, not {sorted(entry)}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    documents = _load_documents(text)
    if len(documents) != 1:
        raise UnsupportedFeature(f"patches: one strategic merge patch per entry, found {len(documents)}")
    return documents[0]


def _apply_patch(objects: list[Manifest], patch: Manifest) -> list[Manifest]:
    kind, name = patch["kind"], patch["metadata"]["name"]
    matches = [i for i, obj in enumerate(objects) if obj["kind"] == kind and obj["metadata"]["name"] == name]
    if len(matches) != 1:
        raise ValueError(f"patch for {kind}/{name} matches {len(matches)} objects, expected exactly one")
    index = matches[0]
    if patch.get(DELETE_DIRECTIVE) == "delete":
        return objects[:index] + objects[index + 1 :]
    patched = list(objects)
    patched[index] = strategic_merge(objects[index], patch)
    return patched


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """Merges `patch` into a copy of `base`: maps key by key (null deletes), keyed lists element by element."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        merged_list = copy.deepcopy(base)
        for item in patch:
            position = next((i for i, old in enumerate(merged_list) if old.get(key) == item[key]), None)
            if position is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[position] = strategic_merge(merged_list[position], item)
        return merged_list
    return copy.deepcopy(patch)


def pod_spec(obj: Manifest) -> dict | None:
    """The pod spec inside a workload (or a Pod), if the object has one."""
    for path in POD_SPEC_PATHS:
        node: Any = obj
        for step in path:
            node = node.get(step) if isinstance(node, dict) else None
        if isinstance(node, dict) and "containers" in node:
            return node
    return None


def split_image(reference: str) -> tuple[str, str | None]:
    """("registry:5000/name", "tag") from "registry:5000/name:tag"; a colon before the last '/' is a port."""
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:
        return reference, None
    return name, tag


def _set_image(obj: Manifest, image: dict) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise UnsupportedFeature(f"images: only name, newName and newTag, not {sorted(image)}")
    spec = pod_spec(obj)
    if spec is None:
        return
    for container in spec.get("initContainers", []) + spec["containers"]:
        name, tag = split_image(container["image"])
        if name != image["name"]:
            continue
        new_name = image.get("newName", name)
        new_tag = image.get("newTag", tag)
        container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name
