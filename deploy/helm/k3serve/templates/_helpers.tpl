{{/* Names: 40 characters at most, KubeRay derives pod and Service names from the RayCluster's. */}}
{{- define "k3serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "k3serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "k3serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "k3serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "k3serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "k3serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "k3serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The `model` value of the k3serve config: a directory, or a preset name. */}}
{{- define "k3serve.modelArg" -}}
{{- if eq .Values.model.source "preset" }}{{ .Values.model.preset }}{{ else }}{{ .Values.model.mountPath }}{{ end }}
{{- end }}

{{/*
Pods of a pool for a number of replicas: ceil(replicas * tp / gpusPerPod), one pod per replica on
CPU. A TP group either fills whole pods (tp a multiple of gpusPerPod) or packs into one.
  include "k3serve.pods" (dict "role" .Values.prefill "name" "prefill" "replicas" 2)
*/}}
{{- define "k3serve.pods" -}}
{{- $r := .role }}
{{- $tp := int $r.tp }}
{{- $gpus := int $r.gpusPerPod }}
{{- $n := int .replicas }}
{{- if eq $gpus 0 }}
{{- $n }}
{{- else }}
{{- if and (gt $tp $gpus) (ne (mod $tp $gpus) 0) }}
{{- fail (printf "%s.tp=%d spans pods of %d GPUs unevenly: make tp a multiple of gpusPerPod" .name $tp $gpus) }}
{{- end }}
{{- if and (le $tp $gpus) (ne (mod $gpus $tp) 0) }}
{{- fail (printf "%s.tp=%d does not divide gpusPerPod=%d: GPUs would idle" .name $tp $gpus) }}
{{- end }}
{{- div (add (mul $n $tp) (sub $gpus 1)) $gpus }}
{{- end }}
{{- end }}

{{/* "true" when a monitoring object should render: enabled true, or auto and the CRD API is served. */}}
{{- define "k3serve.monitoringOn" -}}
{{- $enabled := index . 0 }}
{{- $ctx := index . 1 }}
{{- if eq (toString $enabled) "auto" }}
{{- $ctx.Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}
{{- else }}
{{- toString $enabled }}
{{- end }}
{{- end }}

{{/*
Env of every Ray container: transferEnv (sorted), the pod IP, then extraEnv. K3SERVE_HOST_IP (the
pod IP, its only source) is the address every k3serve worker in the pod binds its servers on and
advertises to the other pods (decode control plane, Mooncake, TP group rendezvous); the actors
inherit it from `ray start`.
*/}}
{{- define "k3serve.env" -}}
{{- range $k := keys .Values.transferEnv | sortAlpha }}
- name: {{ $k }}
  value: {{ index $.Values.transferEnv $k | toString | quote }}
{{- end }}
- name: K3SERVE_HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes shared by every pod: /dev/shm and the model. */}}
{{- define "k3serve.volumes" -}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSize }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required for model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hf" }}
{{- if .Values.model.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
{{- else }}
- name: model
  emptyDir:
    sizeLimit: {{ .Values.model.hf.emptyDirSizeLimit }}
{{- end }}
{{- end }}
{{- end }}

{{- define "k3serve.volumeMounts" -}}
- name: shm
  mountPath: /dev/shm
{{- if ne .Values.model.source "preset" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  {{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
  readOnly: true
{{- end }}
{{- end }}

{{/* For model.source=hf: download the checkpoint before Ray starts (resumable; idempotent). */}}
{{- define "k3serve.initContainers" -}}
{{- if eq .Values.model.source "hf" }}
- name: model-download
  image: {{ include "k3serve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["hf", "download", {{ required "model.hf.id is required for model.source=hf" .Values.model.hf.id | quote }},
            "--revision", {{ .Values.model.hf.revision | quote }}, "--local-dir", {{ .Values.model.mountPath | quote }}]
  {{- with .Values.model.hf.tokenSecret.name }}
  env:
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $.Values.model.hf.tokenSecret.key }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
      {{- with .Values.model.pvc.subPath }}
      subPath: {{ . }}
      {{- end }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every pod. */}}
{{- define "k3serve.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- end }}
