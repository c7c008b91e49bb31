"""Training-job manifests of each supported kind as their authors write them, the namespace and
flavor the kube tests render them into, and the pod templates a manifest carries."""

from __future__ import annotations

from typing import Any

from kinds.base import PodTemplate
from kinds.registry import adapter_of
from tests.kube.conftest import make_config


def manifest_templates(manifest: dict[str, Any]) -> list[PodTemplate]:
    """The pod templates of a supported manifest with their podset names."""
    return adapter_of(manifest).templates(manifest)


def templates_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [t.template for t in manifest_templates(body)]


NS = "muster-workloads"
FLAVOR = make_config().flavors[0]  # a100-spot, pool=a100, toleration nvidia.com/gpu

PYTORCHJOB_YAML = """
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: pytorch-ddp-mnist
  namespace: ml-training
spec:
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template:
        metadata:
          annotations:
            sidecar.istio.io/inject: 'false'
        spec:
          containers:
            - name: pytorch
              image: my-registry/pytorch-training:latest
              command: ['torchrun', '--nproc_per_node=2', '--nnodes=3', 'train.py']
              env:
                - name: NCCL_DEBUG
                  value: 'INFO'
              resources:
                limits:
                  nvidia.com/gpu: 2
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        spec:
          affinity:
            nodeAffinity:
              requiredDuringSchedulingIgnoredDuringExecution:
                nodeSelectorTerms:
                  - matchExpressions:
                      - {key: topology.kubernetes.io/zone, operator: In, values: [us-east-1a]}
          containers:
            - name: pytorch
              image: my-registry/pytorch-training:latest
              resources:
                limits:
                  nvidia.com/gpu: 2
"""

MPIJOB_YAML = """
apiVersion: kubeflow.org/v2beta1
kind: MPIJob
metadata:
  name: horovod-training
spec:
  slotsPerWorker: 2
  mpiReplicaSpecs:
    Launcher:
      replicas: 1
      template:
        spec:
          containers:
            - name: mpi-launcher
              image: horovod/horovod:latest
              command: [mpirun, --allow-run-as-root, -np, '8', python, train.py]
    Worker:
      replicas: 4
      template:
        spec:
          containers:
            - name: mpi-worker
              image: horovod/horovod:latest
              resources:
                limits:
                  nvidia.com/gpu: 2
"""

TFJOB_YAML = """
apiVersion: kubeflow.org/v1
kind: TFJob
metadata:
  name: tf-ps-training
spec:
  tfReplicaSpecs:
    PS:
      replicas: 2
      template:
        spec:
          containers:
            - name: tensorflow
              image: tensorflow/tensorflow:2.14.0-gpu
    Worker:
      replicas: 4
      template:
        spec:
          containers:
            - name: tensorflow
              image: tensorflow/tensorflow:2.14.0-gpu
              resources:
                limits:
                  nvidia.com/gpu: 1
"""

VOLCANO_YAML = """
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata:
  name: pytorch-ddp-training
spec:
  minAvailable: 5
  schedulerName: volcano
  queue: ml-research-queue
  policies:
    - event: PodEvicted
      action: RestartJob
  tasks:
    - replicas: 1
      name: master
      template:
        spec:
          containers:
            - image: pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime
              name: master
              resources:
                limits:
                  nvidia.com/gpu: 1
          restartPolicy: OnFailure
    - replicas: 4
      name: worker
      template:
        spec:
          containers:
            - image: pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime
              name: worker
              resources:
                limits:
                  nvidia.com/gpu: 1
          restartPolicy: OnFailure
"""

JOBSET_YAML = """
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: js
spec:
  replicatedJobs:
    - name: workers
      replicas: 2
      template:
        spec:
          parallelism: 2
          completions: 2
          template:
            spec:
              containers:
                - name: trainer
                  image: trainer:1
"""

BATCH_JOB_YAML = """
apiVersion: batch/v1
kind: Job
metadata:
  name: single
spec:
  backoffLimit: 6
  template:
    spec:
      restartPolicy: Never
      containers:
        - name: main
          image: busybox
"""
