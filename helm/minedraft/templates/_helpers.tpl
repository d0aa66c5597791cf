{{/* Chart name, overridable. */}}
{{- define "minedraft.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; components append -target, -draft, -coordinator. */}}
{{- define "minedraft.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of one component's Deployment and Service, at most 63 characters with the component kept.
Call with (dict "root" $ "component" "target").
*/}}
{{- define "minedraft.componentName" -}}
{{- $base := include "minedraft.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-" }}
{{- printf "%s-%s" $base .component }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "minedraft.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "minedraft.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: minedraft
{{- end }}

{{/* Selector labels of one component. Call with (dict "root" $ "component" "target"). */}}
{{- define "minedraft.selectorLabels" -}}
app.kubernetes.io/name: {{ include "minedraft.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* repository@digest when image.digest is given (what a scanner asks for), else repository:tag. */}}
{{- define "minedraft.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* The data-plane channel the coordinator asks for. */}}
{{/* The data-plane channel the coordinator asks for: auto inside a pair's pod (cuda-ipc between its GPUs), nccl
     between the split layout's pods. */}}
{{- define "minedraft.channel" -}}
{{- if .Values.coordinator.channel }}{{ .Values.coordinator.channel }}
{{- else if eq .Values.layout "pair" }}auto
{{- else }}nccl
{{- end }}
{{- end }}

{{/* Pod annotations: Prometheus scrape hints plus .Values.podAnnotations. */}}
{{- define "minedraft.podAnnotations" -}}
{{- if .Values.metrics.prometheusAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Container env from a dict of NAME -> value, sorted by name. Null and "" values are left out, so
the CLI's default applies. Whole numbers print as integers (Helm reads YAML numbers as floats).
*/}}
{{- define "minedraft.env" -}}
{{- range $name, $value := . }}
{{- if not (kindIs "invalid" $value) }}
{{- $text := toString $value }}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{- $text = toString (int64 $value) }}
{{- end }}
{{- if ne $text "" }}
- name: {{ $name }}
  value: {{ $text | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* gRPC health probes (grpc.health.v1) on a port. Liveness asks for the "liveness" service, which stays SERVING
     while the process serves: a coordinator whose target is lost (or that drains) reports NOT_SERVING overall, so
     that it gets no traffic, but must not be restarted for it. The kubelet's gRPC probe speaks no TLS: with
     tls.secretName the probes only open the port (tcpSocket). Call with (dict "root" $ "port" N). */}}
{{- define "minedraft.probes" -}}
{{- $p := .root.Values.probes }}
{{- $tcp := .root.Values.tls.secretName }}
startupProbe:
  {{- if $tcp }}
  tcpSocket:
    port: {{ .port }}
  {{- else }}
  grpc:
    port: {{ .port }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.startupFailureThreshold }}
livenessProbe:
  {{- if $tcp }}
  tcpSocket:
    port: {{ .port }}
  {{- else }}
  grpc:
    port: {{ .port }}
    service: liveness
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: 3
readinessProbe:
  {{- if $tcp }}
  tcpSocket:
    port: {{ .port }}
  {{- else }}
  grpc:
    port: {{ .port }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: 2
{{- end }}

{{/* The models volume (models.volume.type: pvc or hostPath), without its name. */}}
{{- define "minedraft.modelsVolume" -}}
{{- $v := .Values.models.volume }}
{{- if eq $v.type "pvc" }}
persistentVolumeClaim:
  claimName: {{ required "models.volume.claimName is required with type pvc" $v.claimName }}
  readOnly: true
{{- else if eq $v.type "hostPath" }}
hostPath:
  path: {{ required "models.volume.hostPath is required with type hostPath" $v.hostPath }}
  type: Directory
{{- else }}
{{- fail (printf "models.volume.type must be pvc or hostPath, not %q" $v.type) }}
{{- end }}
{{- end }}

{{/* Checks of the values that no schema expresses; called once, from validate.yaml. */}}
{{- define "minedraft.validate" -}}
{{- if hasKey .Values "sameNode" }}
{{- fail "sameNode is gone: cuda-ipc needs no hostIPC now, the default layout: pair runs target and draft in one pod (layout: split runs them in pods of their own, over nccl)" }}
{{- end }}
{{- if not (has .Values.layout (list "pair" "split")) }}
{{- fail (printf "layout must be pair or split, not %q" (toString .Values.layout)) }}
{{- end }}
{{- range $component := list "target" "draft" }}
{{- $gpus := int (index $.Values $component).gpus }}
{{- if lt $gpus 0 }}
{{- fail (printf "%s.gpus must be 0 or more (above 1: its tensor-parallel ranks, one GPU each), not %d" $component $gpus) }}
{{- end }}
{{- if and (eq $gpus 0) (hasPrefix "cuda" (toString (index $.Values $component).device)) }}
{{- fail (printf "%s.gpus is 0 but %s.device is %s: give it its GPU (gpus: 1), share the target's in the pair layout (pair.sharedGpu: true), or run it on the CPU (device: cpu)" $component $component (toString (index $.Values $component).device)) }}
{{- end }}
{{- end }}
{{- if eq .Values.layout "pair" }}
{{- /* A shared GPU gives the pod the target's GPUs alone: the draft's ranks must find theirs among them. */}}
{{- $targetGpus := ternary (int .Values.target.gpus) 0 (hasPrefix "cuda" (toString .Values.target.device)) }}
{{- if and .Values.pair.sharedGpu (gt $targetGpus 0) (ne .Values.coordinator.mode "ar") (hasPrefix "cuda" (toString .Values.draft.device)) (gt (int .Values.draft.gpus) $targetGpus) }}
{{- fail (printf "draft.gpus is %d but target.gpus is %d with pair.sharedGpu: the draft's tensor-parallel ranks share the target's GPUs (cuda:0 on), and the pod has %d. Set draft.gpus to %d or fewer, or pair.sharedGpu: false (the draft's GPUs then follow the target's)" (int .Values.draft.gpus) $targetGpus $targetGpus $targetGpus) }}
{{- end }}
{{- /* serve gives both workers one value of these: the target's. */}}
{{- range $component := list "target" "draft" }}
{{- if ne (toString (index $.Values $component).maxBatchSize) "" }}
{{- fail (printf "%s.maxBatchSize is for layout: split; the pair layout's `minedraft serve` gives its three services one value: set coordinator.maxBatchSize" $component) }}
{{- end }}
{{- end }}
{{- range $key := list "dtype" "compile" "precaptureGraphs" "maxModelLen" "blockSize" "kvCacheMemory" "gpuMemoryUtilization" "enablePrefixCaching" }}
{{- $draft := toString (index $.Values.draft $key) }}
{{- if and (ne $draft "") (ne $draft (toString (index $.Values.target $key))) }}
{{- fail (printf "draft.%s is %q but target.%s is %q: the pair layout runs both workers with one `minedraft serve`, which gives them one value, target.%s. Leave draft.%s empty, or use layout: split" $key $draft $key (toString (index $.Values.target $key)) $key $key) }}
{{- end }}
{{- end }}
{{- else }}
{{- if .Values.autoscaling.enabled }}
{{- fail "autoscaling.enabled needs layout: pair (in the split layout one coordinator drives one target and one draft; scale by pairs)" }}
{{- end }}
{{- if gt (int .Values.replicas) 1 }}
{{- fail "replicas > 1 needs layout: pair (the split layout runs one target, one draft and one coordinator)" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The pod's securityContext: a fixed non-root UID, RuntimeDefault seccomp. */}}
{{- define "minedraft.podSecurityContext" -}}
{{- $s := .Values.securityContext }}
runAsNonRoot: true
runAsUser: {{ $s.runAsUser }}
runAsGroup: {{ $s.runAsGroup }}
fsGroup: {{ $s.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* A container's securityContext: nothing to escalate to, no capabilities, a read-only root filesystem. */}}
{{- define "minedraft.containerSecurityContext" -}}
{{- $s := .Values.securityContext }}
runAsNonRoot: true
runAsUser: {{ $s.runAsUser }}
runAsGroup: {{ $s.runAsGroup }}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Where the services write with a read-only root filesystem: /tmp (serve's port files, compile scratch) and one
     cache directory for Hugging Face, Triton, TorchInductor, CuPy and the CUDA driver's JIT cache. */}}
{{- define "minedraft.cacheEnv" -}}
{{- $cache := "/home/minedraft/.cache" }}
- name: HOME
  value: /home/minedraft
- name: XDG_CACHE_HOME
  value: {{ $cache }}
- name: HF_HOME
  value: {{ $cache }}/huggingface
- name: TRITON_HOME
  value: {{ $cache }}
- name: TRITON_CACHE_DIR
  value: {{ $cache }}/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ $cache }}/torchinductor
- name: CUPY_CACHE_DIR
  value: {{ $cache }}/cupy
- name: CUDA_CACHE_PATH
  value: {{ $cache }}/nv
{{- end }}

{{/* TLS and API-token files and the lease secret from Secrets, set only when their values are given (the flags that read them are
     newer than some images). Call with (dict "root" $ "public" true) for a container that serves the public API. */}}
{{- define "minedraft.secretEnv" -}}
{{- $v := .root.Values }}
{{- if $v.tls.secretName }}
- name: MINEDRAFT_TLS_CERT
  value: /etc/minedraft/tls/tls.crt
- name: MINEDRAFT_TLS_KEY
  value: /etc/minedraft/tls/tls.key
{{- if $v.tls.ca }}
- name: MINEDRAFT_TLS_CA
  value: /etc/minedraft/tls/ca.crt
{{- end }}
{{- end }}
{{- if and .public $v.apiKey.secretName }}
- name: MINEDRAFT_API_KEY_FILE
  value: /etc/minedraft/api-key/{{ $v.apiKey.key }}
{{- end }}
{{- if $v.leaseSecret.secretName }}
- name: MINEDRAFT_LEASE_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ $v.leaseSecret.secretName }}
      key: {{ $v.leaseSecret.key }}
{{- end }}
{{- end }}

{{/* The volumes every pod mounts besides the models: tmp, cache, dshm, and the Secrets that are given. */}}
{{- define "minedraft.volumes" -}}
{{- $v := .root.Values }}
- name: models
  {{- include "minedraft.modelsVolume" .root | trim | nindent 2 }}
- name: tmp
  emptyDir:
    sizeLimit: {{ $v.writable.tmpSize }}
- name: cache
  emptyDir:
    sizeLimit: {{ $v.writable.cacheSize }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- if $v.tls.secretName }}
- name: tls
  secret:
    secretName: {{ $v.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and .public $v.apiKey.secretName }}
- name: api-key
  secret:
    secretName: {{ $v.apiKey.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "minedraft.volumeMounts" -}}
{{- $v := .root.Values }}
- name: models
  mountPath: {{ $v.models.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/minedraft/.cache
- name: dshm
  mountPath: /dev/shm
{{- if $v.tls.secretName }}
- name: tls
  mountPath: /etc/minedraft/tls
  readOnly: true
{{- end }}
{{- if and .public $v.apiKey.secretName }}
- name: api-key
  mountPath: /etc/minedraft/api-key
  readOnly: true
{{- end }}
{{- end }}

{{/* Pod-level settings every pod shares: no service-account token, the security context, pull secrets. */}}
{{- define "minedraft.podCommon" -}}
automountServiceAccountToken: false
# No Service variables: a Service named minedraft would set MINEDRAFT_PORT=tcp://..., which --port reads.
enableServiceLinks: false
securityContext:
  {{- include "minedraft.podSecurityContext" . | trim | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* nvidia.com/gpu added to a resources dict (requests and limits). Call with (dict "resources" R "gpus" N). */}}
{{- define "minedraft.resources" -}}
{{- $resources := deepCopy (default (dict) .resources) }}
{{- if gt (int .gpus) 0 }}
{{- $gpu := dict "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $resources "limits" (merge (default (dict) $resources.limits) $gpu) }}
{{- $_ := set $resources "requests" (merge (default (dict) $resources.requests) $gpu) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* A NetworkPolicy ingress rule: the metrics port, from networkPolicy.metricsFrom only (nothing when it is empty). */}}
{{- define "minedraft.metricsIngress" -}}
{{- with .Values.networkPolicy.metricsFrom }}
- from:
    {{- toYaml . | nindent 4 }}
  ports:
    - port: metrics
      protocol: TCP
{{- end }}
{{- end }}
