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

{{- define "minedraft.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The data-plane channel the coordinator asks for. */}}
{{- define "minedraft.channel" -}}
{{- if .Values.coordinator.channel }}{{ .Values.coordinator.channel }}
{{- else if .Values.sameNode }}cuda-ipc
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
     that it gets no traffic, but must not be restarted for it. */}}
{{- define "minedraft.probes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
  failureThreshold: {{ .root.Values.probes.startupFailureThreshold }}
livenessProbe:
  grpc:
    port: {{ .port }}
    service: liveness
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
  failureThreshold: 3
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
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
